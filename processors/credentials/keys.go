package credentials

import (
	"cmp"
	"crypto/ed25519"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"time"
)

// signingKey is one of the broker's Ed25519 keys. It is never printed: the
// Broker's Format stops fmt from reaching it.
type signingKey struct {
	kid     string
	created time.Time
	// activates is when the key starts signing; it is published from
	// created.
	activates time.Time
	priv      ed25519.PrivateKey
	header    string // jwsHeaderSegment(kid)
}

func newKey(kid string, created, activates time.Time, priv ed25519.PrivateKey) *signingKey {
	return &signingKey{kid: kid, created: created.UTC(), activates: activates.UTC(), priv: priv, header: jwsHeaderSegment(kid)}
}

// epoch is the key's epoch, the Unix second it starts signing: what
// names the credential families it signs (FamilyOf). A broker's keys
// start signing at least CacheFor apart, so each has an epoch of its own;
// two executors' keys that started in the same second share their
// families, which widens a revocation of one to both.
func (k *signingKey) epoch() int64 { return k.activates.Unix() }

func (k *signingKey) public() ed25519.PublicKey { return k.priv.Public().(ed25519.PublicKey) }

// newSigningKey makes a key created at now that signs from activates.
func newSigningKey(now, activates time.Time) (*signingKey, error) {
	pub, priv, err := ed25519.GenerateKey(nil) // nil: crypto/rand
	if err != nil {
		return nil, fmt.Errorf("generate signing key: %v", err)
	}
	return newKey(thumbprint(pub), now, activates, priv), nil
}

// keyFile is a key on disk: <dir>/<kid>.json, mode 0600.
type keyFile struct {
	Kid     string    `json:"kid"`
	Created time.Time `json:"created"`
	// Activates is when the key starts signing; absent (files of older
	// builds, whose keys signed as soon as they were made): Created.
	Activates time.Time `json:"activates,omitzero"`
	// Seed is the RFC 8032 private key seed, base64url.
	Seed string `json:"seed"`
}

// keyStore persists keys in a directory; an empty dir keeps them in memory
// only. One broker owns a directory: two brokers rotating in one directory
// would each publish only their own keys.
type keyStore struct {
	dir string
}

const keyFileSuffix = ".json"

// load returns the stored keys, newest (the latest to start signing)
// first. A file that others may read,
// or whose key does not match its kid, is an error: the broker refuses to
// sign with a key that may have leaked or been swapped.
func (s keyStore) load() ([]*signingKey, error) {
	if s.dir == "" {
		return nil, nil
	}
	if err := os.MkdirAll(s.dir, 0o700); err != nil {
		return nil, fmt.Errorf("key dir: %w", err)
	}
	entries, err := os.ReadDir(s.dir)
	if err != nil {
		return nil, fmt.Errorf("key dir: %w", err)
	}
	var keys []*signingKey
	for _, e := range entries {
		name := e.Name()
		if e.IsDir() || strings.HasPrefix(name, ".") || !strings.HasSuffix(name, keyFileSuffix) {
			continue // temporary files of an interrupted save, and others
		}
		k, err := s.read(name)
		if err != nil {
			return nil, err
		}
		keys = append(keys, k)
	}
	sortNewestFirst(keys)
	return keys, nil
}

func (s keyStore) read(name string) (*signingKey, error) {
	path := filepath.Join(s.dir, name)
	info, err := os.Stat(path)
	if err != nil {
		return nil, fmt.Errorf("key file: %w", err)
	}
	if perm := info.Mode().Perm(); perm&0o077 != 0 {
		return nil, fmt.Errorf("key file %s is open to other users (mode %#o); it must be 0600", path, perm)
	}
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("key file: %w", err)
	}
	// Parse errors are not passed on: their text can quote the file's
	// bytes, which are the private key.
	var f keyFile
	if err := json.Unmarshal(b, &f); err != nil {
		return nil, fmt.Errorf("key file %s is not a key file", path)
	}
	seed, err := b64.DecodeString(f.Seed)
	if err != nil || len(seed) != ed25519.SeedSize {
		return nil, fmt.Errorf("key file %s holds no Ed25519 seed", path)
	}
	k := newKey(f.Kid, f.Created, cmp.Or(f.Activates, f.Created), ed25519.NewKeyFromSeed(seed))
	if thumbprint(k.public()) != f.Kid || name != f.Kid+keyFileSuffix {
		return nil, fmt.Errorf("key file %s: the key does not match its kid", path)
	}
	return k, nil
}

// save writes k atomically (temporary file, fsync, rename) with mode 0600.
func (s keyStore) save(k *signingKey) error {
	if s.dir == "" {
		return nil
	}
	b, err := json.Marshal(keyFile{Kid: k.kid, Created: k.created, Activates: k.activates, Seed: b64.EncodeToString(k.priv.Seed())})
	if err != nil {
		return fmt.Errorf("encode key file: %v", err)
	}
	tmp, err := os.CreateTemp(s.dir, ".key-*.tmp") // CreateTemp opens 0600
	if err != nil {
		return fmt.Errorf("save key: %w", err)
	}
	defer os.Remove(tmp.Name()) // after the rename, a no-op
	if _, err := tmp.Write(b); err != nil {
		tmp.Close()
		return fmt.Errorf("save key: %w", err)
	}
	if err := tmp.Sync(); err != nil {
		tmp.Close()
		return fmt.Errorf("save key: %w", err)
	}
	if err := tmp.Close(); err != nil {
		return fmt.Errorf("save key: %w", err)
	}
	if err := os.Rename(tmp.Name(), filepath.Join(s.dir, k.kid+keyFileSuffix)); err != nil {
		return fmt.Errorf("save key: %w", err)
	}
	return s.syncDir()
}

// remove deletes a key that rotated out of the published set.
func (s keyStore) remove(k *signingKey) error {
	if s.dir == "" {
		return nil
	}
	if err := os.Remove(filepath.Join(s.dir, k.kid+keyFileSuffix)); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return fmt.Errorf("remove retired key: %w", err)
	}
	return s.syncDir()
}

// syncDir makes a rename or removal durable.
func (s keyStore) syncDir() error {
	d, err := os.Open(s.dir)
	if err != nil {
		return fmt.Errorf("sync key dir: %w", err)
	}
	defer d.Close()
	if err := d.Sync(); err != nil {
		return fmt.Errorf("sync key dir: %w", err)
	}
	return nil
}

func sortNewestFirst(keys []*signingKey) {
	slices.SortFunc(keys, func(a, b *signingKey) int {
		if c := b.activates.Compare(a.activates); c != 0 {
			return c
		}
		return cmp.Compare(a.kid, b.kid)
	})
}
