package credentials

import (
	"container/heap"
	"context"
	"crypto/ed25519"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/url"
	"slices"
	"sync"
	"sync/atomic"
	"time"
)

// Defaults of VerifierConfig.
const (
	DefaultSkew       = 30 * time.Second
	DefaultCacheFor   = 60 * time.Second
	DefaultMinRefresh = time.Second
)

// VerifierConfig configures a Verifier. At least one of Keys and JWKSURLs
// must be set.
type VerifierConfig struct {
	// Audience is the aud a credential must carry: the backend's own
	// audience. Expect.Audience overrides it per call. If both are empty
	// every credential is refused (wrong_audience) by Verify; Inspect
	// ignores it.
	Audience string
	// Issuer is the iss a credential must carry. Default: DefaultIssuer.
	Issuer string
	// Keys returns a published key set (JWKS JSON) in the same process:
	// the broker's Keys method.
	Keys func(ctx context.Context) ([]byte, error)
	// JWKSURLs are where to fetch the published key sets, one per broker
	// whose credentials are to verify: every executor's --jwks-addr and
	// the reconciler's, such as
	// https://executor-0.executor:8443/.well-known/jwks.json. Every broker
	// signs with keys of its own, so a verifier given one broker's set
	// refuses the others' credentials. Each URL must be https, or http on
	// a loopback address unless AllowInsecureHTTP is set: keys fetched in
	// clear over a network can be swapped. Each set (and the one from
	// Keys) is cached and refreshed on its own, and a kid found in any of
	// them is used: one unreachable URL refuses (keys_unavailable) only the
	// credentials that no other set verifies.
	JWKSURLs []string
	// AllowInsecureHTTP permits http JWKSURLs on non-loopback hosts.
	AllowInsecureHTTP bool
	// HTTPClient fetches JWKSURLs. Default: a client with a 10 s timeout.
	HTTPClient *http.Client
	// Now is the clock. Default: time.Now.
	Now func() time.Time
	// Skew is the clock difference tolerated on exp and nbf. Default:
	// DefaultSkew (30 s). Must not be negative.
	Skew time.Duration
	// CacheFor is how long a fetched key set is used before it is fetched
	// again; each set on its own schedule. Default: DefaultCacheFor (60 s,
	// the broker's max-age).
	CacheFor time.Duration
	// MinRefresh is the least time between two fetches of one set: a
	// token with an unknown kid triggers a fetch of every set (the key may
	// have just rotated in any), at most this often, so that made-up kids
	// cannot flood the key servers.
	// Default: DefaultMinRefresh (1 s).
	MinRefresh time.Duration
	// Logger receives key set fetch failures (Warn). Default: discard.
	Logger *slog.Logger
	// Revocations, when set, is asked by Verify about every credential
	// that passes the other checks, so that a credential the ledger's
	// kill switch revoked (the credential, or its family) is refused
	// (ReasonRevoked) rather than honoured until it expires; when it
	// cannot answer, Verify refuses with ReasonRevocationUnavailable (a
	// tool answers 503). An Introspector asks the ledger's
	// /v1/introspect. Nil: revocations are not checked.
	Revocations Revocations
}

func (c *VerifierConfig) setDefaults() {
	if c.Issuer == "" {
		c.Issuer = DefaultIssuer
	}
	if c.HTTPClient == nil {
		c.HTTPClient = &http.Client{Timeout: 10 * time.Second}
	}
	if c.Now == nil {
		c.Now = time.Now
	}
	if c.Skew == 0 {
		c.Skew = DefaultSkew
	}
	if c.CacheFor == 0 {
		c.CacheFor = DefaultCacheFor
	}
	if c.MinRefresh == 0 {
		c.MinRefresh = DefaultMinRefresh
	}
	if c.Logger == nil {
		c.Logger = slog.New(slog.DiscardHandler)
	}
}

func (c VerifierConfig) validate() error {
	switch {
	case c.Keys == nil && len(c.JWKSURLs) == 0:
		return fmt.Errorf("%w: set Keys or JWKSURLs", ErrInvalidConfig)
	case c.Skew < 0 || c.CacheFor < 0 || c.MinRefresh < 0:
		return fmt.Errorf("%w: Skew, CacheFor and MinRefresh must not be negative", ErrInvalidConfig)
	}
	// The messages name the URL by its place in the list: a URL may carry
	// a credential in its query.
	for i, raw := range c.JWKSURLs {
		if err := CheckURL(raw, c.AllowInsecureHTTP); err != nil {
			return fmt.Errorf("%w: JWKSURLs[%d] %v", ErrInvalidConfig, i, err)
		}
	}
	// At the start, not at the first credential: an Introspector
	// refuses to ask over a URL it finds wrong.
	if ch, ok := c.Revocations.(interface{ Check() error }); ok {
		if err := ch.Check(); err != nil {
			return fmt.Errorf("%w: Revocations: %v", ErrInvalidConfig, err)
		}
	}
	return nil
}

// CheckURL says what is wrong with raw as the URL of a service that
// credentials are fetched from or sent to (a key set, an introspection
// endpoint, a ledger API taking a bearer): one reached in clear over a
// network can be read or swapped, so it must be https, or http on
// loopback unless allowInsecureHTTP. The error does not quote the URL,
// whose query may carry a credential.
func CheckURL(raw string, allowInsecureHTTP bool) error {
	u, err := url.Parse(raw)
	if err != nil || u.Host == "" {
		return errors.New("is not an absolute URL")
	}
	switch u.Scheme {
	case "https":
	case "http":
		if !allowInsecureHTTP && !isLoopback(u.Hostname()) {
			return errors.New("must be https off loopback")
		}
	default:
		return fmt.Errorf("scheme %q is not http(s)", u.Scheme)
	}
	return nil
}

func isLoopback(host string) bool {
	if host == "localhost" {
		return true
	}
	ip := net.ParseIP(host)
	return ip != nil && ip.IsLoopback()
}

// Expect is what the request presenting a credential is about. Every
// field is compared exactly; an empty Scope, Tenant or IdempotencyKey
// matches no credential, so a caller that forgets one fails closed.
type Expect struct {
	// Scope is the action the request performs, "tool::<name>".
	Scope string
	// Tenant is the tenant the request acts in (X-Ledger-Tenant).
	Tenant string
	// IdempotencyKey is the call the request belongs to (Idempotency-Key).
	IdempotencyKey string
	// Audience, when set, overrides VerifierConfig.Audience.
	Audience string
}

// Verifier checks credentials for a tool: signature under a published key,
// issuer, audience, expiry, scope, tenant and call, one call per jti, and,
// for a tool that spends them (Spend), one effect per credential.
// It is safe for concurrent use.
type Verifier struct {
	cfg     VerifierConfig
	sources []*keySource

	seenMu sync.Mutex
	seen   map[string]seenJTI
	byExp  expiryHeap
}

// keySource is one published key set the verifier trusts: a broker's
// JWKS URL, or VerifierConfig.Keys. Each is fetched, cached and rate
// limited on its own, so that one failing set does not hide the others.
type keySource struct {
	// name says which set in logs: "keys" for VerifierConfig.Keys, or
	// "jwks_urls[i]" (a URL may carry a credential in its query).
	name  string
	fetch func(ctx context.Context) ([]byte, error)

	// set is the last fetched set, read without a lock by every
	// verification.
	set atomic.Pointer[keySet]

	// mu guards the fields below. Concurrent verifications wait for one
	// fetch of the set (inflight, closed when it ends) instead of each
	// starting its own.
	mu       sync.Mutex
	triedAt  time.Time
	lastErr  error
	inflight chan struct{}
}

// keySet is a fetched key set and when it was fetched.
type keySet struct {
	keys      map[string]ed25519.PublicKey
	fetchedAt time.Time
}

// seenJTI is an accepted jti: the call it was accepted for, the scopes it
// was spent for, and until when it must be remembered (the latest exp it
// was presented or spent with, plus the skew, after which Verify refuses
// it as expired anyway).
type seenJTI struct {
	idempotencyKey string
	until          time.Time
	// spent are the scopes the jti was spent for (Spend), in which Verify
	// refuses it from then on: one, the call's action, in practice.
	spent []string
}

// NewVerifier returns a Verifier. It fetches no keys until the first
// Verify.
func NewVerifier(cfg VerifierConfig) (*Verifier, error) {
	cfg.setDefaults()
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	v := &Verifier{cfg: cfg, seen: make(map[string]seenJTI)}
	if cfg.Keys != nil {
		v.sources = append(v.sources, &keySource{name: "keys", fetch: cfg.Keys})
	}
	for i, u := range cfg.JWKSURLs {
		v.sources = append(v.sources, &keySource{name: fmt.Sprintf("jwks_urls[%d]", i), fetch: func(ctx context.Context) ([]byte, error) {
			return v.fetchURL(ctx, u)
		}})
	}
	return v, nil
}

// Verify checks token for a request described by want and returns its
// claims. A refusal is an *Error whose Reason says why (see the Reason
// constants); keys_unavailable means the verifier could not get the key
// set, not that the token is bad.
//
// Replay: an accepted jti is remembered, bound to the idempotency key it
// was accepted for, until it expires. The same jti again for the same key
// is accepted (a retry of the same call with the same credential, such as
// after a lost answer); for another key it is refused as replayed, whatever
// else is wrong with that presentation. A jti that was spent (Spend) is
// refused as spent in the scope it was spent for, retries of its own call
// included: a tool that does not deduplicate spends each credential as it
// applies its effect, so that a credential leaked with its request causes
// that effect once, however often the request is sent again.
func (v *Verifier) Verify(ctx context.Context, token string, want Expect) (Claims, error) {
	w, err := v.signed(ctx, token)
	if err != nil {
		return Claims{}, err
	}
	aud := want.Audience
	if aud == "" {
		aud = v.cfg.Audience
	}
	if aud == "" || w.Aud != aud {
		return Claims{}, reject(ReasonWrongAudience, "aud %s, want %s", quote(w.Aud), quote(aud))
	}
	c := w.claims()
	now := v.cfg.Now()
	if err := v.current(now, c); err != nil {
		return Claims{}, err
	}
	if err := v.accept(now, c, want); err != nil {
		return Claims{}, err
	}
	// Last: a network round trip, after every check that costs none.
	if err := CheckRevoked(ctx, v.cfg.Revocations, token); err != nil {
		return Claims{}, err
	}
	return c, nil
}

// Inspect checks token for an introspection endpoint (RFC 7662), which
// answers for any backend: signature under a published key, issuer,
// expiry and not-before, and nothing about the request (no audience,
// scope, tenant or call), so a Verifier with an empty Audience serves. It
// remembers nothing: an inspected jti may still be presented once to its
// backend, and inspecting it again is no replay. Refusals are *Error as
// from Verify. Whether the credential was revoked is the caller's to
// check, from the returned JTI and Family.
func (v *Verifier) Inspect(ctx context.Context, token string) (Claims, error) {
	w, err := v.signed(ctx, token)
	if err != nil {
		return Claims{}, err
	}
	c := w.claims()
	if err := v.current(v.cfg.Now(), c); err != nil {
		return Claims{}, err
	}
	return c, nil
}

// signed parses token, checks its signature under a published key and its
// issuer, and returns its claims; what they are good for is the caller's
// to check.
func (v *Verifier) signed(ctx context.Context, token string) (wireClaims, error) {
	if token == "" {
		return wireClaims{}, reject(ReasonMissingToken, "no bearer token")
	}
	p, err := parseJWS(token)
	if err != nil {
		return wireClaims{}, err
	}
	pub, err := v.key(ctx, p.kid)
	if err != nil {
		return wireClaims{}, err
	}
	if !p.verify(pub) {
		return wireClaims{}, reject(ReasonBadSignature, "signature does not verify under kid %s", quote(p.kid))
	}
	var w wireClaims
	if err := json.Unmarshal(p.payload, &w); err != nil {
		return wireClaims{}, reject(ReasonMalformed, "claims are not a JSON object of the credential's claims")
	}
	if w.Exp == 0 || w.JTI == "" {
		return wireClaims{}, reject(ReasonMalformed, "exp and jti are required")
	}
	if w.Iss != v.cfg.Issuer {
		return wireClaims{}, reject(ReasonWrongIssuer, "iss %s, want %s", quote(w.Iss), quote(v.cfg.Issuer))
	}
	return w, nil
}

// current checks that c is within its validity window at now, give or
// take the skew.
func (v *Verifier) current(now time.Time, c Claims) error {
	if !now.Before(c.ExpiresAt.Add(v.cfg.Skew)) {
		return reject(ReasonExpired, "expired at %s", c.ExpiresAt.Format(time.RFC3339))
	}
	if now.Add(v.cfg.Skew).Before(c.NotBefore) {
		return reject(ReasonNotYetValid, "not before %s", c.NotBefore.Format(time.RFC3339))
	}
	return nil
}

// accept runs the replay check and the request checks, and remembers the
// jti, under one lock: two presentations of one jti for two calls at once
// cannot both pass.
func (v *Verifier) accept(now time.Time, c Claims, want Expect) error {
	v.seenMu.Lock()
	defer v.seenMu.Unlock()
	prev, seen := v.seen[c.JTI]
	switch {
	case seen && prev.idempotencyKey != want.IdempotencyKey:
		return reject(ReasonReplayed, "jti %s was accepted for another call", quote(c.JTI))
	case c.Scope != want.Scope:
		return reject(ReasonWrongScope, "scope %s, want %s", quote(c.Scope), quote(want.Scope))
	case c.Tenant != want.Tenant:
		return reject(ReasonWrongTenant, "tenant %s, want %s", quote(c.Tenant), quote(want.Tenant))
	case c.IdempotencyKey != want.IdempotencyKey:
		return reject(ReasonWrongCall, "minted for another idempotency key")
	case seen && slices.Contains(prev.spent, c.Scope):
		// A renewal of it (same jti, later exp) is remembered spent for
		// as long as it is good.
		v.rememberLocked(now, c, want.IdempotencyKey, nil)
		return reject(ReasonSpent, "jti %s already had its effect", quote(c.JTI))
	}
	// A retry of the call it was accepted for (seen), or its first
	// presentation.
	v.rememberLocked(now, c, want.IdempotencyKey, nil)
	return nil
}

// Spend records that the request whose credential Verify returned c for
// has had its effect: from then until the credential expires (exp plus
// the skew; a renewal of it, same jti and a later exp, until that one
// expires), Verify refuses its jti in its scope (c.Scope) as
// ReasonSpent, retries of its own call included. A credential of the
// call in another scope, such as the reconciler's status lookup's (scope
// "tool::<name>:status"), is not affected, even under the same jti.
//
// A tool whose effect is not deduplicated by the idempotency key calls
// Spend just before it applies the effect, under whatever makes its
// effects one at a time, and applies nothing if Spend refuses: Spend
// returns an *Error, ReasonSpent, when the credential was already spent
// (two presentations at once, both verified before either spent), so
// that of any number of presentations of one credential one has its
// effect. A request refused before that (not applied: a 429, or a 503
// with X-Ledger-Not-Applied) must not be spent: the ledger sends it again
// with the same credential. Once spent, answer nothing that says not
// applied. A tool that deduplicates by key (native) need not spend: a
// retry of its call replays the first answer.
//
// Spent jtis are remembered with the accepted ones, in memory and bounded
// by their expiry: a verifier that restarts forgets them.
func (v *Verifier) Spend(c Claims) error {
	if c.JTI == "" || c.Scope == "" {
		return reject(ReasonMalformed, "only a verified credential, with its jti and scope, can be spent")
	}
	v.seenMu.Lock()
	defer v.seenMu.Unlock()
	prev, seen := v.seen[c.JTI]
	if seen && slices.Contains(prev.spent, c.Scope) {
		return reject(ReasonSpent, "jti %s already had its effect", quote(c.JTI))
	}
	v.rememberLocked(v.cfg.Now(), c, c.IdempotencyKey, &c.Scope)
	return nil
}

// rememberLocked forgets the jtis past their time, and remembers c's jti
// (for key, if it is new) until c expires unless it is remembered for
// longer already, spent in *spend if set. What is known of c's jti is
// kept even if its time was up: c, a later credential of it, is good.
// v.seenMu must be held.
func (v *Verifier) rememberLocked(now time.Time, c Claims, key string, spend *string) {
	s, seen := v.seen[c.JTI]
	for len(v.byExp) > 0 && !now.Before(v.byExp[0].until) {
		e := heap.Pop(&v.byExp).(expiry)
		// A jti remembered for longer since (presented again with a
		// later exp) has a later entry of its own.
		if r, ok := v.seen[e.jti]; ok && !r.until.After(e.until) {
			delete(v.seen, e.jti)
		}
	}
	_, kept := v.seen[c.JTI]
	if !seen {
		s.idempotencyKey = key
	}
	if spend != nil && !slices.Contains(s.spent, *spend) {
		s.spent = append(s.spent, *spend)
	}
	if until := c.ExpiresAt.Add(v.cfg.Skew); !kept || until.After(s.until) {
		s.until = until
		heap.Push(&v.byExp, expiry{jti: c.JTI, until: until})
	}
	v.seen[c.JTI] = s
}

// remembered returns how many jtis the verifier holds.
func (v *Verifier) remembered() int {
	v.seenMu.Lock()
	defer v.seenMu.Unlock()
	return len(v.seen)
}

// key returns the public key kid names from the first current set that
// holds it. When none does, it fetches every set (those too old, and any
// other in case kid has just rotated in), each at most once per
// MinRefresh, and looks again. Kids are RFC 7638 thumbprints, so two sets
// naming one kid name one key.
func (v *Verifier) key(ctx context.Context, kid string) (ed25519.PublicKey, error) {
	now := v.cfg.Now()
	if pub, ok := v.cached(now, kid); ok {
		return pub, nil
	}
	// First the sets too old to use, which may hold kid; only if none
	// does, the current ones, in case kid has just rotated into one. So a
	// set expiring does not make every other set be fetched too.
	pub, errs := v.refresh(ctx, now, kid, func(i int) bool { return !v.sources[i].current(v, now) })
	if pub != nil {
		return pub, nil
	}
	pub, more := v.refresh(ctx, now, kid, func(i int) bool { return errs[i] == nil })
	if pub != nil {
		return pub, nil
	}
	for i, err := range more {
		if errs[i] == nil {
			errs[i] = err
		}
	}
	// kid is in no set at hand. If a set could not be had, kid may be in
	// it: that is the key server's failure, not the token's.
	if err := errors.Join(errs...); err != nil {
		return nil, &Error{Reason: ReasonKeysUnavailable, Err: err}
	}
	return nil, reject(ReasonUnknownKid, "kid %s is not in the published key sets", quote(kid))
}

// refresh fetches the sets that want says to, in parallel, and returns
// kid's key as soon as it is at hand: a set slow to answer, or hung until
// the fetch timeout, delays only the kids no other set holds. Otherwise,
// once every fetch is over, it returns each one's error.
func (v *Verifier) refresh(ctx context.Context, now time.Time, kid string, want func(i int) bool) (ed25519.PublicKey, []error) {
	// Cancelled on return, it releases the waits still on; the fetches
	// themselves run to their end and count (keySource.refresh).
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	type result struct {
		i   int
		err error
	}
	results := make(chan result, len(v.sources)) // no sender blocks
	n := 0
	for i, s := range v.sources {
		if want(i) {
			n++
			go func() { results <- result{i, s.refresh(ctx, v, now)} }()
		}
	}
	errs := make([]error, len(v.sources))
	for range n {
		r := <-results
		errs[r.i] = r.err
		if pub, ok := v.cached(now, kid); ok {
			return pub, nil
		}
	}
	// Also with nothing fetched here: another caller's fetch may have
	// brought kid since key looked.
	if pub, ok := v.cached(now, kid); ok {
		return pub, nil
	}
	return nil, errs
}

// cached returns kid's key from the first set fetched less than CacheFor
// ago that holds it. Fail closed: an older set is not used, since it may
// still hold a key its broker has withdrawn.
func (v *Verifier) cached(now time.Time, kid string) (ed25519.PublicKey, bool) {
	for _, s := range v.sources {
		if !s.current(v, now) {
			continue
		}
		if pub, ok := s.set.Load().keys[kid]; ok {
			return pub, true
		}
	}
	return nil, false
}

// current reports whether the source has a set fetched less than
// CacheFor ago.
func (s *keySource) current(v *Verifier, now time.Time) bool {
	set := s.set.Load()
	return set != nil && now.Before(set.fetchedAt.Add(v.cfg.CacheFor))
}

// refresh fetches the set, at most once per MinRefresh; within that
// interval it returns the last attempt's outcome. It returns nil when the
// set at hand is current (fetched now, or within MinRefresh and still
// within CacheFor).
func (s *keySource) refresh(ctx context.Context, v *Verifier, now time.Time) error {
	s.mu.Lock()
	if s.inflight == nil {
		if !s.triedAt.IsZero() && now.Before(s.triedAt.Add(v.cfg.MinRefresh)) {
			defer s.mu.Unlock()
			if s.lastErr == nil && !s.current(v, now) {
				// Only with a CacheFor below MinRefresh.
				return fmt.Errorf("key set %s expired within MinRefresh of its fetch", s.name)
			}
			return s.lastErr
		}
		// The fetch runs to its end, and counts, whoever asked for it
		// gave up: else a caller presenting made-up kids and hanging up
		// at once would start a fetch of every source each time, past
		// MinRefresh. Callers wait for it as long as they like.
		done := make(chan struct{})
		s.inflight = done
		go s.fetchSet(context.WithoutCancel(ctx), v, now, done)
	}
	done := s.inflight
	s.mu.Unlock()
	select {
	case <-done:
	case <-ctx.Done():
		return fmt.Errorf("fetch key set %s: %w", s.name, ctx.Err())
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.lastErr
}

// fetchSet fetches the set, records the outcome as the attempt at now,
// and closes done.
func (s *keySource) fetchSet(ctx context.Context, v *Verifier, now time.Time, done chan struct{}) {
	ctx, cancel := context.WithTimeout(ctx, keyFetchTimeout)
	defer cancel()
	b, err := s.fetch(ctx)
	var keys map[string]ed25519.PublicKey
	if err == nil {
		keys, err = parseJWKS(b)
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	defer close(done)
	s.inflight = nil
	if err != nil {
		s.triedAt, s.lastErr = now, fmt.Errorf("fetch key set %s: %w", s.name, err)
		v.cfg.Logger.Warn("credential key set unavailable", "key_set", s.name, "err", err)
		return
	}
	s.triedAt, s.lastErr = now, nil
	s.set.Store(&keySet{keys: keys, fetchedAt: now})
}

// keyFetchTimeout bounds one fetch of a key set.
const keyFetchTimeout = 10 * time.Second

func (v *Verifier) fetchURL(ctx context.Context, u string) ([]byte, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, u, nil)
	if err != nil {
		return nil, err
	}
	req.Header.Set("Accept", "application/jwk-set+json, application/json")
	resp, err := noRedirects(v.cfg.HTTPClient).Do(req)
	if err != nil {
		if ue, ok := errors.AsType[*url.Error](err); ok {
			err = ue.Err // without the URL, which may carry a credential
		}
		return nil, fmt.Errorf("GET: %w", err)
	}
	defer resp.Body.Close()
	if resp.StatusCode >= 300 && resp.StatusCode < 400 {
		return nil, fmt.Errorf("GET: status %d: redirects are not followed (configure the URL it points to)", resp.StatusCode)
	}
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("GET: status %d", resp.StatusCode)
	}
	return io.ReadAll(io.LimitReader(resp.Body, maxJWKSBytes+1))
}

// expiry is a remembered jti in the purge order.
type expiry struct {
	jti   string
	until time.Time
}

// expiryHeap orders remembered jtis by when they may be forgotten, so that
// each insert purges the expired ones in O(log n) each.
type expiryHeap []expiry

func (h expiryHeap) Len() int           { return len(h) }
func (h expiryHeap) Less(i, j int) bool { return h[i].until.Before(h[j].until) }
func (h expiryHeap) Swap(i, j int)      { h[i], h[j] = h[j], h[i] }
func (h *expiryHeap) Push(x any)        { *h = append(*h, x.(expiry)) }
func (h *expiryHeap) Pop() any {
	old := *h
	e := old[len(old)-1]
	*h = old[:len(old)-1]
	return e
}
