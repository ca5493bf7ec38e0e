// Package credentials is the per-call credential broker (DESIGN.md §5,
// Credentials) and the verifier that tools use to check what it mints.
//
// For every execution the broker mints a short-lived JWT (EdDSA, typ
// ledger-credential+jwt): issuer the ledger, audience the tool's backend,
// subject the user, the agent and the executor instance as nested RFC 8693
// actors, the tenant, one action as scope, a random jti bound to the call's
// idempotency key, the digest of the request's body (body_sha256: a tool
// checks it with Claims.CheckBody once it read the body, so that a leaked
// credential cannot carry other arguments), and an expiry of min(deadline,
// TTL). The signing key
// rotates; the published JWKS (GET /.well-known/jwks.json) holds the
// current key, the next one from CacheFor before it signs, and a retired
// one until every token it signed has expired.
//
// The token is a secret. It is never in an event, a log line or an error:
// Credential and Broker print redacted under every fmt verb, slog and JSON,
// and no error of this package quotes a token or key bytes.
//
// File map: broker.go (Broker, Grant, Credential, rotation, JWKS handler),
// keys.go (signing keys and their 0600 files), verifier.go (Verifier, key
// cache, replay memory), claims.go (Claims, Reason, Error), jws.go and
// jwk.go (the compact JWS and JWK encodings, kept apart to be replaceable).
package credentials

import (
	"cmp"
	"context"
	"crypto/rand"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"strconv"
	"sync"
	"time"
)

// Defaults of Config. Skew and CacheFor default to DefaultSkew and
// DefaultCacheFor, the verifier's.
const (
	DefaultIssuer      = "toolcall-ledger"
	DefaultTTL         = 5 * time.Minute
	DefaultRotateEvery = 24 * time.Hour
)

// JWKSPath is where Handler serves the published keys.
const JWKSPath = "/.well-known/jwks.json"

// rotateRetry is how long the broker waits before it tries again to rotate
// after a new key could not be saved.
const rotateRetry = time.Minute

var (
	// ErrInvalidConfig: a Config field is out of range.
	ErrInvalidConfig = errors.New("invalid credentials config")
	// ErrInvalidGrant: a Grant lacks a field every credential needs.
	ErrInvalidGrant = errors.New("invalid grant")
	// ErrDeadlinePassed: the call's deadline leaves no time for a
	// credential; the call should expire, not run.
	ErrDeadlinePassed = errors.New("deadline passed")
	// ErrFamilyChanged: the grant names a family (Grant.Family) that the
	// key signing now does not: the broker's key rotated since the
	// family was read. Nothing is minted.
	ErrFamilyChanged = errors.New("credential family changed")
)

// Config configures a Broker. The zero value is a working in-memory broker.
type Config struct {
	// Issuer is the iss of every credential. Default: DefaultIssuer.
	Issuer string
	// TTL is the longest a credential lives; a sooner call deadline
	// shortens it. Default: DefaultTTL (5 min). At least a second.
	TTL time.Duration
	// RotateEvery is how long a key signs before the next one takes
	// over, checked at each Mint and each read of the JWKS (no
	// goroutine). Default: DefaultRotateEvery (24 h). It must be at least
	// MinRotateEvery: a new key is published CacheFor before it signs,
	// and a retired one stays published for TTL+Skew+CacheFor after, so
	// rotating faster would retire keys whose tokens still live. It also
	// bounds the set at two keys: the current one, and the next or the
	// last retired one.
	RotateEvery time.Duration
	// Skew is the clock difference the verifiers tolerate on exp
	// (VerifierConfig.Skew): a retired key stays published until its
	// last token's exp plus Skew. Default: DefaultSkew (30 s).
	Skew time.Duration
	// CacheFor is how long verifiers and HTTP caches may keep the
	// published set: Handler's max-age. A new key is published this long
	// before it signs, so that a verifier whose cached set predates it
	// (or that refetched within its MinRefresh) knows it by then; a
	// retired key stays this long past its tokens as a margin. It must be
	// no less than the verifiers' VerifierConfig.CacheFor. Default:
	// DefaultCacheFor (60 s).
	CacheFor time.Duration
	// Now is the clock. Default: time.Now.
	Now func() time.Time
	// KeyDir, when set, persists the signing keys as 0600 files (the
	// directory is created 0700), so that a restart keeps them, the
	// tokens they signed and the time each starts signing. A key file that
	// other users may read is refused. One broker per directory: two would
	// each publish only their own keys after a rotation. Empty: keys live
	// in memory only.
	KeyDir string
	// Logger receives rotations (Info) and key file errors (Error); never a
	// token or key bytes. Default: discard.
	Logger *slog.Logger
}

func (c *Config) setDefaults() {
	if c.Issuer == "" {
		c.Issuer = DefaultIssuer
	}
	if c.TTL == 0 {
		c.TTL = DefaultTTL
	}
	if c.RotateEvery == 0 {
		c.RotateEvery = DefaultRotateEvery
	}
	if c.Skew == 0 {
		c.Skew = DefaultSkew
	}
	if c.CacheFor == 0 {
		c.CacheFor = DefaultCacheFor
	}
	if c.Now == nil {
		c.Now = time.Now
	}
	if c.Logger == nil {
		c.Logger = slog.New(slog.DiscardHandler)
	}
}

func (c Config) validate() error {
	switch {
	case c.TTL < time.Second:
		// A credential expires on a whole second: one shorter would
		// expire before most mints (ErrDeadlinePassed), each taken for
		// a claim with too little lease left and given back.
		return fmt.Errorf("%w: TTL %v is under a second, and credentials expire on whole seconds", ErrInvalidConfig, c.TTL)
	case c.Skew < 0 || c.CacheFor < 0:
		return fmt.Errorf("%w: Skew and CacheFor must not be negative", ErrInvalidConfig)
	case c.RotateEvery < c.MinRotateEvery():
		return fmt.Errorf("%w: RotateEvery %v is below %v: a key is published CacheFor (%v) before it signs and kept TTL (%v) + Skew (%v) + CacheFor after",
			ErrInvalidConfig, c.RotateEvery, c.MinRotateEvery(), c.CacheFor, c.TTL, c.Skew)
	}
	return nil
}

// MinRotateEvery is the least RotateEvery the other fields allow (each
// zero one as its default): CacheFor of publication before a key signs,
// plus TTL+Skew+CacheFor of publication after it stopped.
func (c Config) MinRotateEvery() time.Duration {
	ttl, skew, cache := cmp.Or(c.TTL, DefaultTTL), cmp.Or(c.Skew, DefaultSkew), cmp.Or(c.CacheFor, DefaultCacheFor)
	return cache + ttl + skew + cache
}

// keepRetired is how long a key stays published after it stopped
// signing: its last token lives TTL, a verifier accepts it Skew longer,
// and CacheFor is a margin for verifiers' clocks and caches.
func (c Config) keepRetired() time.Duration { return c.TTL + c.Skew + c.CacheFor }

// Broker mints per-call credentials and publishes the keys that verify
// them. It is safe for concurrent use.
type Broker struct {
	cfg   Config
	store keyStore

	mu      sync.Mutex
	current *signingKey
	// next is published but does not sign before its activates; nil
	// until the current key is CacheFor from its rotation.
	next *signingKey
	// retired are the keys that signed before current, newest first,
	// each published until the one after it has signed for
	// cfg.keepRetired().
	retired []*signingKey
	jwks    []byte
	// noRotateBefore delays the next rotation attempt after a failed one.
	noRotateBefore time.Time
}

// New returns a Broker. With cfg.KeyDir it loads the stored keys (the
// newest that has started signing signs, a newer one is published as the
// next, older ones as retired while their tokens may live) or creates and
// saves the first one, which signs at once since no other key could sign
// in its place (a verifier meeting its kid fetches the set again).
func New(cfg Config) (*Broker, error) {
	cfg.setDefaults()
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	b := &Broker{cfg: cfg, store: keyStore{dir: cfg.KeyDir}}
	keys, err := b.store.load()
	if err != nil {
		return nil, err
	}
	now := cfg.Now()
	if len(keys) == 0 {
		k, err := newSigningKey(now, now)
		if err != nil {
			return nil, err
		}
		if err := b.store.save(k); err != nil {
			return nil, err
		}
		keys = []*signingKey{k}
	}
	// keys is newest first. The current key is the newest that has
	// started signing, or the oldest if none has (a clock set back).
	cur := len(keys) - 1
	for i, k := range keys {
		if !now.Before(k.activates) {
			cur = i
			break
		}
	}
	b.current, b.retired = keys[cur], keys[cur+1:]
	if cur > 0 {
		b.next = keys[cur-1]
		// More than one key yet to sign can only come of a clock set
		// back; they never signed, so nothing depends on them.
		for _, k := range keys[:cur-1] {
			b.removeLocked(k)
		}
	}
	b.advanceLocked(now)
	b.publishLocked()
	cfg.Logger.Info("credential broker ready", "kid", b.current.kid, "key_epoch", b.current.epoch(), "next_kid", b.nextKID(), "retired_keys", len(b.retired), "key_dir", cfg.KeyDir)
	return b, nil
}

// Grant is what one credential is for: one call, by one executor instance,
// for one user and agent of one tenant, at one tool.
type Grant struct {
	Tenant string
	User   string
	Agent  string
	// Executor is the executor instance that runs the call.
	Executor    string
	Tool        string
	ToolVersion int
	// Action is the scope; default ToolScope(Tool), the tool's action.
	Action string
	// Audience is the tool backend's audience, from the registry
	// (backend.audience).
	Audience       string
	CallID         string
	IdempotencyKey string
	// Deadline is the call's deadline; zero: none.
	Deadline time.Time
	// BodySHA256 is the BodyDigest of the request's body, binding the
	// credential to it; empty: bound to none.
	BodySHA256 string
	// JTI, when set, is the credential's jti (from NewJTI), chosen
	// before the mint so that the call's claim records it before any
	// request leaves; empty: a fresh one.
	JTI string
	// Family, when set, is the family the caller recorded for the
	// credential (FamilyOf with KeyEpoch's epoch): if the key signing now
	// names another, Mint refuses with ErrFamilyChanged rather than mint
	// a credential other than the one recorded.
	Family string
}

// NewJTI returns a fresh jti: 128 random bits, base64url.
func NewJTI() string {
	var id [16]byte
	_, _ = rand.Read(id[:]) // crypto/rand.Read never fails (it aborts the program instead)
	return b64.EncodeToString(id[:])
}

func (g Grant) validate() error {
	for _, f := range [...]struct{ name, v string }{
		{"Tenant", g.Tenant}, {"User", g.User}, {"Agent", g.Agent}, {"Executor", g.Executor},
		{"Tool", g.Tool}, {"Audience", g.Audience}, {"IdempotencyKey", g.IdempotencyKey},
	} {
		if f.v == "" {
			return fmt.Errorf("%w: %s is required", ErrInvalidGrant, f.name)
		}
	}
	return nil
}

// FamilyOf is the credential family of a tool's credentials for tenant
// signed by the key of an epoch (KeyEpoch): tool:tenant:epoch, what a
// revocation names. Each executor signs with keys of its own, so a family
// is one executor's credentials for one tool and tenant over one key's
// life, and the events name it: what a responder revokes when those may
// have leaked, and looks up to see everything they touched.
func FamilyOf(tool, tenant string, epoch int64) string {
	return tool + ":" + tenant + ":" + strconv.FormatInt(epoch, 10)
}

// Credential is a minted token and what the ledger records about it. The
// token itself is never printed: fmt (every verb), slog and encoding/json
// see the other fields and "[redacted]".
type Credential struct {
	// Token is the compact JWS, for the Authorization: Bearer header of
	// the one call it was minted for, and nothing else.
	Token string
	JTI   string
	// Family is "<tool>:<tenant>:<key epoch>" (FamilyOf), the credential
	// family an incident responder revokes.
	Family string
	// IssuedAt is its iat, in the whole seconds a token carries: what a
	// family's revocation is compared with (a revocation covers the
	// family's credentials issued up to its window's end).
	IssuedAt  time.Time
	ExpiresAt time.Time
	// Scope is the one action the token allows.
	Scope string
}

const redacted = "[redacted]"

// String returns the credential without its token.
func (c Credential) String() string {
	return fmt.Sprintf("credentials.Credential{JTI:%q Family:%q Scope:%q ExpiresAt:%s Token:%s}",
		c.JTI, c.Family, c.Scope, c.ExpiresAt.Format(time.RFC3339), redacted)
}

// GoString returns String, so that %#v does not print the token either.
func (c Credential) GoString() string { return c.String() }

// Format prints String under every verb, so that %x or %q cannot reach the
// token.
func (c Credential) Format(f fmt.State, _ rune) { _, _ = io.WriteString(f, c.String()) }

// LogValue returns the credential without its token for slog.
func (c Credential) LogValue() slog.Value {
	return slog.GroupValue(
		slog.String("jti", c.JTI),
		slog.String("family", c.Family),
		slog.String("scope", c.Scope),
		slog.Time("expires_at", c.ExpiresAt),
	)
}

// MarshalJSON encodes the credential with its token redacted; a token
// travels as a header, never inside a JSON document.
func (c Credential) MarshalJSON() ([]byte, error) {
	return json.Marshal(struct {
		JTI       string    `json:"jti"`
		Family    string    `json:"family"`
		Scope     string    `json:"scope"`
		ExpiresAt time.Time `json:"expires_at"`
		Token     string    `json:"token"`
	}{c.JTI, c.Family, c.Scope, c.ExpiresAt, redacted})
}

// Mint returns a credential for g, signed by the current key; it first
// rotates the key if it has reached Config.RotateEvery. The token expires
// at min(g.Deadline, now+TTL), truncated to the second.
func (b *Broker) Mint(g Grant) (Credential, error) {
	if err := g.validate(); err != nil {
		return Credential{}, err
	}
	if g.Action == "" {
		g.Action = ToolScope(g.Tool)
	}
	now := b.cfg.Now()
	exp := now.Add(b.cfg.TTL)
	if !g.Deadline.IsZero() && g.Deadline.Before(exp) {
		exp = g.Deadline
	}
	// NumericDate is whole seconds; truncating never extends past the
	// deadline.
	expiresAt := time.Unix(exp.Unix(), 0).UTC()
	if !expiresAt.After(now) {
		return Credential{}, fmt.Errorf("mint %s for %s: %w", g.Tool, g.IdempotencyKey, ErrDeadlinePassed)
	}

	key := b.signingKey(now)
	family := FamilyOf(g.Tool, g.Tenant, key.epoch())
	if g.Family != "" && g.Family != family {
		return Credential{}, fmt.Errorf("mint %s for %s: family %s recorded, the key signing now names %s: %w", g.Tool, g.IdempotencyKey, g.Family, family, ErrFamilyChanged)
	}
	jti := g.JTI
	if jti == "" {
		jti = NewJTI()
	}
	cred := Credential{
		JTI:       jti,
		Family:    family,
		IssuedAt:  time.Unix(now.Unix(), 0).UTC(),
		ExpiresAt: expiresAt,
		Scope:     g.Action,
	}
	executor := Actor{Subject: g.Executor}
	claims := wireClaims{
		Iss:            b.cfg.Issuer,
		Aud:            g.Audience,
		Sub:            g.User,
		Act:            &Actor{Subject: g.Agent, Actor: &executor},
		Tenant:         g.Tenant,
		Scope:          g.Action,
		JTI:            cred.JTI,
		Iat:            now.Unix(),
		Nbf:            now.Unix(),
		Exp:            expiresAt.Unix(),
		CallID:         g.CallID,
		IdempotencyKey: g.IdempotencyKey,
		Family:         cred.Family,
		ToolVersion:    g.ToolVersion,
		BodySHA256:     g.BodySHA256,
	}
	// The claims are about 400 bytes; signJWS keeps none of them.
	var buf [512]byte
	cred.Token = signJWS(key.priv, key.header, claims.appendJSON(buf[:0]))
	// Enabled first: the arguments would be boxed for a disabled level
	// too, on every call.
	if b.cfg.Logger.Enabled(context.Background(), slog.LevelDebug) {
		b.cfg.Logger.Debug("credential minted", "jti", cred.JTI, "family", cred.Family, "kid", key.kid,
			"scope", cred.Scope, "aud", g.Audience, "expires_at", cred.ExpiresAt)
	}
	return cred, nil
}

// KeyEpoch is the epoch of the key that signs now (FamilyOf): the Unix
// second it started signing.
func (b *Broker) KeyEpoch() int64 { return b.signingKey(b.cfg.Now()).epoch() }

// signingKey returns the key to sign with at now, rotating first if due.
func (b *Broker) signingKey(now time.Time) *signingKey {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.advanceLocked(now) {
		b.publishLocked()
	}
	return b.current
}

// advanceLocked moves the keys on to now and reports whether the
// published set changed: the next key takes over once it activates; a
// next key is made CacheFor before the current one is due to rotate; a
// retired key is dropped once the key after it has signed for
// keepRetired, so no token it signed is still accepted anywhere.
func (b *Broker) advanceLocked(now time.Time) bool {
	changed := false
	if b.next != nil && !now.Before(b.next.activates) {
		b.cfg.Logger.Info("signing key rotated", "kid", b.next.kid, "key_epoch", b.next.epoch(), "retired_kid", b.current.kid)
		b.current, b.next, b.retired = b.next, nil, append([]*signingKey{b.current}, b.retired...)
		changed = true
	}
	due := b.current.activates.Add(b.cfg.RotateEvery - b.cfg.CacheFor)
	if b.next == nil && !now.Before(due) && !now.Before(b.noRotateBefore) {
		changed = b.prepareNextLocked(now) || changed
	}
	// retired[i] stopped signing when the key before it in the list
	// (current for retired[0]) started.
	successor := b.current
	for i, k := range b.retired {
		if !now.Before(successor.activates.Add(b.cfg.keepRetired())) {
			for _, old := range b.retired[i:] {
				b.removeLocked(old)
			}
			b.retired = b.retired[:i]
			changed = true
			break
		}
		successor = k
	}
	return changed
}

// prepareNextLocked makes and saves the next key, to sign from CacheFor
// after now, and reports whether it did. If the key cannot be saved the
// broker keeps signing with the current one (a token signed by an unsaved
// key would not verify after a restart) and tries again after rotateRetry.
func (b *Broker) prepareNextLocked(now time.Time) bool {
	k, err := newSigningKey(now, now.Add(b.cfg.CacheFor))
	if err == nil {
		err = b.store.save(k)
	}
	if err != nil {
		b.noRotateBefore = now.Add(rotateRetry)
		b.cfg.Logger.Error("signing key rotation failed; still signing with the old key", "kid", b.current.kid, "err", err)
		return false
	}
	b.next = k
	b.cfg.Logger.Info("next signing key published", "kid", k.kid, "signs_from", k.activates)
	return true
}

// removeLocked forgets k's file; the caller drops it from the set.
func (b *Broker) removeLocked(k *signingKey) {
	if err := b.store.remove(k); err != nil {
		b.cfg.Logger.Error("retired signing key not deleted", "kid", k.kid, "err", err)
	}
}

// publishLocked rebuilds the published set: the current key, the next,
// then the retired ones, newest first.
func (b *Broker) publishLocked() {
	set := jwkSet{Keys: []jwk{publicJWK(b.current.kid, b.current.public())}}
	if b.next != nil {
		set.Keys = append(set.Keys, publicJWK(b.next.kid, b.next.public()))
	}
	for _, k := range b.retired {
		set.Keys = append(set.Keys, publicJWK(k.kid, k.public()))
	}
	jwks, err := json.Marshal(set)
	if err != nil {
		panic("credentials: encode JWKS: " + err.Error()) // plain strings cannot fail to encode
	}
	b.jwks = jwks
}

func (b *Broker) nextKID() string {
	if b.next == nil {
		return ""
	}
	return b.next.kid
}

// JWKS returns the published key set at the broker's now: the current
// signing key first, then the next one if it is published yet, then the
// retired ones whose tokens may still be live, newest first. Reading it
// moves the keys on as Mint does, so a broker that mints nothing still
// publishes its next key ahead of time.
func (b *Broker) JWKS() []byte {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.advanceLocked(b.cfg.Now()) {
		b.publishLocked()
	}
	return append([]byte(nil), b.jwks...)
}

// Keys returns JWKS in the form VerifierConfig.Keys takes, for a verifier
// in the same process.
func (b *Broker) Keys(context.Context) ([]byte, error) { return b.JWKS(), nil }

// Handler serves JWKS at GET /.well-known/jwks.json (HEAD too), cacheable
// for Config.CacheFor (a new key is published that long before it signs);
// verifiers refetch sooner when they meet an unknown kid.
func (b *Broker) Handler() http.Handler {
	cacheControl := "public, max-age=" + strconv.Itoa(int(b.cfg.CacheFor/time.Second))
	mux := http.NewServeMux()
	mux.HandleFunc("GET "+JWKSPath, func(w http.ResponseWriter, _ *http.Request) {
		body := b.JWKS()
		w.Header().Set("Content-Type", "application/jwk-set+json")
		w.Header().Set("Cache-Control", cacheControl)
		w.Header().Set("Content-Length", strconv.Itoa(len(body)))
		_, _ = w.Write(body) // a write error means the client left
	})
	return mux
}

// String describes the broker without its keys.
func (b *Broker) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return fmt.Sprintf("credentials.Broker{Issuer:%q KID:%q RetiredKeys:%d}", b.cfg.Issuer, b.current.kid, len(b.retired))
}

// GoString returns String: %#v must not print the private keys.
func (b *Broker) GoString() string { return b.String() }

// Format prints String under every verb; without it, fmt would print the
// private keys held in unexported fields.
func (b *Broker) Format(f fmt.State, _ rune) { _, _ = io.WriteString(f, b.String()) }

// ToolScope is the scope of a credential for tool's action: the side
// effect itself.
func ToolScope(tool string) string { return "tool::" + tool }

// StatusScope is the scope of a credential for a status lookup of tool:
// it reads what a call did, and must not authorize doing it, so it is not
// ToolScope.
func StatusScope(tool string) string { return "tool::" + tool + ":status" }
