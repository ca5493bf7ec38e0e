package identity

import (
	"crypto/rand"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"log/slog"
	"os"
	"path/filepath"
	"time"

	"github.com/toolcall-ledger/ledger/ledger/token"
)

// DefaultMintTTL is the lifetime Mint gives an assertion when asked for
// none.
const DefaultMintTTL = 5 * time.Minute

// Issuer is the dev identity provider: it mints agent assertions with a
// key kept in a file, for `ledger dev`, `ledger token` and tests. It is
// not an identity provider for production, which brings its own (Config's
// JWKSFile or JWKSURL). It is safe for concurrent use.
type Issuer struct {
	name string
	key  token.Key
	keys *token.KeySet
}

// LoadOrCreateIssuer loads the issuer's private JWK from path, or creates
// an Ed25519 key there (mode 0600, its kid the key's RFC 7638 thumbprint)
// when the file does not exist. An existing file must not be readable by
// group or others. Creation is atomic: a concurrent caller either creates
// the file or loads the one the other created.
func LoadOrCreateIssuer(path string, issuer string) (*Issuer, error) {
	if issuer == "" {
		return nil, errors.New("identity: issuer name is empty")
	}
	key, err := loadKey(path)
	if errors.Is(err, fs.ErrNotExist) {
		key, err = createKey(path)
	}
	if err != nil {
		return nil, err
	}
	keys, err := token.NewKeySet(key)
	if err != nil {
		return nil, fmt.Errorf("identity: issuer key %s: %v", path, err)
	}
	return &Issuer{name: issuer, key: key, keys: keys}, nil
}

func loadKey(path string) (token.Key, error) {
	f, err := os.Open(path)
	if err != nil {
		return token.Key{}, err // fs.ErrNotExist is the caller's cue
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		return token.Key{}, fmt.Errorf("identity: issuer key: %v", err)
	}
	if perm := st.Mode().Perm(); perm&0o077 != 0 {
		return token.Key{}, fmt.Errorf("identity: issuer key %s is accessible by group or others (mode %#o); chmod 600 it", path, perm)
	}
	data, err := io.ReadAll(io.LimitReader(f, 64<<10))
	if err != nil {
		return token.Key{}, fmt.Errorf("identity: read issuer key %s: %v", path, err)
	}
	key, err := token.ParsePrivateJWK(data)
	if err != nil {
		// ParsePrivateJWK never quotes the key.
		return token.Key{}, fmt.Errorf("identity: issuer key %s: %v", path, err)
	}
	return key, nil
}

func createKey(path string) (token.Key, error) {
	key, err := token.GenerateEd25519("pending")
	if err != nil {
		return token.Key{}, err
	}
	if key.ID, err = key.Thumbprint(); err != nil {
		return token.Key{}, err
	}
	data, err := token.MarshalPrivateJWK(key)
	if err != nil {
		return token.Key{}, err
	}
	dir := filepath.Dir(path)
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return token.Key{}, fmt.Errorf("identity: create issuer key directory: %v", err)
	}
	// Write a private temporary file (CreateTemp makes it 0600), then link
	// it into place: the key file appears complete or not at all, and
	// os.Link fails rather than replace a key another process just made.
	tmp, err := os.CreateTemp(dir, ".issuer-key-*")
	if err != nil {
		return token.Key{}, fmt.Errorf("identity: create issuer key: %v", err)
	}
	defer os.Remove(tmp.Name())
	if err := tmp.Chmod(0o600); err != nil {
		tmp.Close()
		return token.Key{}, fmt.Errorf("identity: create issuer key: %v", err)
	}
	if _, err := tmp.Write(data); err != nil {
		tmp.Close()
		return token.Key{}, fmt.Errorf("identity: write issuer key: %v", err)
	}
	if err := tmp.Sync(); err != nil {
		tmp.Close()
		return token.Key{}, fmt.Errorf("identity: write issuer key: %v", err)
	}
	if err := tmp.Close(); err != nil {
		return token.Key{}, fmt.Errorf("identity: write issuer key: %v", err)
	}
	if err := os.Link(tmp.Name(), path); err != nil {
		if errors.Is(err, fs.ErrExist) {
			return loadKey(path)
		}
		return token.Key{}, fmt.Errorf("identity: install issuer key: %v", err)
	}
	return key, nil
}

// Issuer returns the issuer name (iss) of the assertions it mints.
func (i *Issuer) Issuer() string { return i.name }

// Keys returns the issuer's public key set, for Config.Keys or to serve as
// a JWKS.
func (i *Issuer) Keys() *token.KeySet { return i.keys }

// Mint returns an assertion for id: typ TypeAssertion, iss, aud (default
// DefaultAudience), sub = User, act = {"sub": Agent}, tenant, purpose,
// roles, iat and nbf now, exp now + ttl (default DefaultMintTTL), and a
// random jti. User, Agent and Tenant are required.
func (i *Issuer) Mint(id Identity, audience string, ttl time.Duration) (string, error) {
	if id.User == "" || id.Agent == "" || id.Tenant == "" {
		return "", errors.New("identity: mint needs a user, an agent and a tenant")
	}
	if audience == "" {
		audience = DefaultAudience
	}
	if ttl <= 0 {
		ttl = DefaultMintTTL
	}
	var jti [16]byte
	if _, err := rand.Read(jti[:]); err != nil {
		return "", fmt.Errorf("identity: jti: %v", err)
	}
	now := time.Now()
	c := Claims{
		Claims: token.Claims{
			Issuer:    i.name,
			Subject:   id.User,
			Audience:  token.Audience{audience},
			ExpiresAt: token.NewNumericDate(now.Add(ttl)),
			NotBefore: token.NewNumericDate(now),
			IssuedAt:  token.NewNumericDate(now),
			ID:        fmt.Sprintf("%x", jti),
		},
		Act:     Actor{Subject: id.Agent},
		Tenant:  id.Tenant,
		Purpose: id.Purpose,
		Roles:   id.Roles,
	}
	tok, err := token.Sign(i.key, TypeAssertion, c)
	if err != nil {
		return "", fmt.Errorf("identity: mint: %v", err)
	}
	return tok, nil
}

// String names the issuer and its key id, never key material.
func (i *Issuer) String() string {
	return fmt.Sprintf("identity.Issuer{issuer:%q kid:%q alg:%q}", i.name, i.key.ID, i.key.Alg)
}

// GoString is String.
func (i *Issuer) GoString() string { return i.String() }

// Format prints String for every verb.
func (i *Issuer) Format(f fmt.State, verb rune) { _, _ = io.WriteString(f, i.String()) }

// LogValue implements slog.LogValuer.
func (i *Issuer) LogValue() slog.Value {
	return slog.GroupValue(slog.String("issuer", i.name), slog.String("kid", i.key.ID))
}
