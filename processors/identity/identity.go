// Package identity verifies the identity assertion an agent host puts in a
// tool-call envelope: a JWT from a configured issuer that says which user
// (sub) an agent (act) acts for, in which tenant, for which purpose. The
// verified Identity, never the envelope's scope or arguments, is who asks
// (DESIGN §3, invariant I5).
//
// Keys come from a JWKS file, a JWKS URL or a static set, and nowhere else.
// File and URL keys are refreshed lazily: there is no background goroutine.
// The first Verify after Config.Refresh has passed since the last attempt
// re-reads the source, synchronously and bounded by a timeout, while
// concurrent calls go on with the keys they have. A token whose kid is not
// in the set triggers at most one early refresh per EarlyRefreshInterval, so
// a key rotated in at the issuer is picked up at once, yet a flood of
// made-up kids cannot make the verifier hammer the JWKS endpoint. A failed
// refresh keeps the old keys and logs a warning.
//
// The dev Issuer (issuer.go) mints assertions for `ledger dev` and tests.
package identity

import (
	"crypto/sha256"
	"slices"

	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/url"
	"os"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/toolcall-ledger/ledger/ledger/httpjson"
	"github.com/toolcall-ledger/ledger/ledger/token"
)

// TypeAssertion is the typ header an agent assertion must carry (explicit
// typing, RFC 8725 §3.11), so that no other JWT from the same issuer (an ID
// token, an access token) passes as one.
const TypeAssertion = "agent-assertion+jwt"

// Defaults of Config.
const (
	// DefaultAudience is the aud an assertion must name: the ledger.
	DefaultAudience = "toolcall-ledger"
	// ApproverAudience is the aud of an approver's or operator's
	// assertion. It differs from DefaultAudience so that an agent's
	// assertion can never act as an approver's, nor an approver's submit
	// calls.
	ApproverAudience = "toolcall-ledger-approvals"
	// DefaultRefresh is how often keys are re-read at most.
	DefaultRefresh = 5 * time.Minute
	// DefaultMaxStale is how long the keys last loaded are trusted while
	// every refresh fails.
	DefaultMaxStale = 24 * time.Hour
	// DefaultSkew is the clock skew allowed on exp, nbf and iat.
	DefaultSkew = 30 * time.Second
	// MaxSkew bounds Config.Skew: more would make expiry meaningless.
	MaxSkew = 5 * time.Minute
	// DefaultMaxLifetime is the longest an assertion may be valid by
	// default: an hour, ample for an agent, which mints a fresh one
	// before the old one ends (the issuers in this repository, `ledger
	// submit`, `ledger token`, the bench and the dev console, stay within
	// it), and short enough that a leaked assertion is not a bearer
	// credential for long.
	DefaultMaxLifetime = time.Hour
	// MaxMaxLifetime bounds Config.MaxLifetime: a day covers a human's
	// console session; more is a standing credential, which an
	// assertion must never be.
	MaxMaxLifetime = 24 * time.Hour
)

// EarlyRefreshInterval is the least time between two refreshes triggered
// by an unknown kid.
const EarlyRefreshInterval = time.Minute

// FetchTimeout bounds one read of the key source.
const FetchTimeout = 10 * time.Second

// ReasonMissingAssertion is the *token.Error reason for an empty assertion.
// The other reasons are token's, including token.ReasonMissingClaim when
// sub, tenant or act is absent.
const ReasonMissingAssertion = "missing_assertion"

// ReasonLifetimeTooLong is the *token.Error reason for an assertion valid
// for longer than Config.MaxLifetime: its exp lies further than that (plus
// the skew) from now, or further than that from its iat. The intake
// reports it as "assertion_lifetime_too_long".
const ReasonLifetimeTooLong = "lifetime_too_long"

// ReasonKeysStale is the *token.Error reason for every assertion once the
// issuer's keys could not be loaded for longer than Config.MaxStale: the
// issuer may have withdrawn a key since, a compromised one say, and the
// keys at hand would still accept what it signed. The intake reports it
// as "assertion_keys_stale".
const ReasonKeysStale = "keys_stale"

// StaleRetryAfter is the RetryAfter of a refusal for stale keys
// (ReasonKeysStale): long enough that every agent's resends during an
// identity provider's outage cost little.
const StaleRetryAfter = 30 * time.Second

// ForNowError is a refusal that says nothing of the assertion: this
// verifier cannot judge it now. The issuer's keys are stale here
// (ReasonKeysStale), or the assertion's kid is none of the keys at hand
// and they could not be loaded again since it arrived
// (token.ReasonUnknownKID): the issuer may have rotated to a key
// published after the last load, and the next early refresh is
// RetryAfter away, or the last one failed. Sent again after RetryAfter,
// the assertion may pass. Err holds the reason (token.ReasonOf finds
// it).
type ForNowError struct {
	Err        *token.Error
	RetryAfter time.Duration
}

func (e *ForNowError) Error() string { return e.Err.Error() }

// Unwrap returns Err.
func (e *ForNowError) Unwrap() error { return e.Err }

// RetryAfter reports whether err refuses an assertion for now only
// (ForNowError), and after how long to send it again.
func RetryAfter(err error) (time.Duration, bool) {
	if e, ok := errors.AsType[*ForNowError](err); ok {
		return e.RetryAfter, true
	}
	return 0, false
}

// Identity is who asks, from a verified assertion.
type Identity struct {
	// User is the subject (sub): the user the agent acts for.
	User string
	// Agent is the actor (act): the agent making the call.
	Agent string
	// Tenant is the tenant the user acts in.
	Tenant string
	// Purpose is the declared purpose, if any.
	Purpose string
	// Roles are the user's roles, such as "approver" or "operator".
	Roles []string
}

// Claims are the claims of an agent assertion: the registered claims plus
// act, tenant, purpose and roles.
type Claims struct {
	token.Claims
	// Act is the agent (RFC 8693 §4.1).
	Act Actor `json:"act,omitzero"`
	// Tenant is the tenant id.
	Tenant string `json:"tenant,omitempty"`
	// Purpose is optional.
	Purpose string `json:"purpose,omitempty"`
	// Roles are optional.
	Roles []string `json:"roles,omitempty"`
}

// Actor is the act claim. It reads either a string (the agent id) or an
// RFC 8693 actor object {"sub": agent, ...}, of which only the outermost
// sub counts (a nested act is the delegation history, not the caller). It
// writes the object form.
type Actor struct {
	Subject string
}

// MarshalJSON writes {"sub": subject}.
func (a Actor) MarshalJSON() ([]byte, error) {
	return json.Marshal(struct {
		Sub string `json:"sub"`
	}{a.Subject})
}

// UnmarshalJSON reads a string or an object with a string sub.
func (a *Actor) UnmarshalJSON(b []byte) error {
	var v any
	if err := json.Unmarshal(b, &v); err != nil {
		return err
	}
	switch v := v.(type) {
	case nil:
		return nil
	case string:
		a.Subject = v
		return nil
	case map[string]any:
		if sub, ok := v["sub"].(string); ok {
			a.Subject = sub
			return nil
		}
	}
	return errors.New("act: want a string or an object with a string sub")
}

// Config configures a Verifier. Exactly one of JWKSFile, JWKSURL and Keys
// must be set.
type Config struct {
	// Issuer is the required iss, compared exactly. Required.
	Issuer string
	// Audience is the aud the assertion must contain; default
	// DefaultAudience.
	Audience string
	// OtherAudiences are other roles' audiences (the staff's for the
	// agents' verifier, the agents' for the staff's): an assertion whose
	// aud names one of them too is refused (aud_mismatch), so that one
	// issued for both, as an identity provider's mapper that adds every
	// audience does, never acts as the other role's assertion. Audience
	// itself is never refused.
	OtherAudiences []string
	// JWKSFile is a JWKS document on disk, re-read every Refresh.
	JWKSFile string
	// JWKSURL is a JWKS document served over https (http only on a
	// loopback address), re-fetched every Refresh. The body is capped at
	// token.MaxJWKSBytes and a fetch at FetchTimeout.
	JWKSURL string
	// Keys is a static key set, for tests and dev; never refreshed.
	Keys *token.KeySet
	// Refresh is the least time between two scheduled refreshes; default
	// DefaultRefresh. An unknown kid may add one early refresh per
	// EarlyRefreshInterval.
	Refresh time.Duration
	// MaxStale is how long the keys last loaded from JWKSFile or JWKSURL
	// are used while every refresh fails (the source unreachable,
	// blocked, or serving a set this verifier refuses); past it every
	// assertion is refused (ReasonKeysStale) until a refresh succeeds.
	// Default DefaultMaxStale; negative: for ever.
	MaxStale time.Duration
	// Skew is the clock skew allowed on exp, nbf and iat; default
	// DefaultSkew, at most MaxSkew.
	Skew time.Duration
	// MaxLifetime is the longest an assertion may be valid: one whose exp
	// lies more than MaxLifetime + Skew after now, or, when it carries
	// iat, more than MaxLifetime after iat, is refused with
	// ReasonLifetimeTooLong. exp alone cannot bound an assertion (an
	// issuer may set it years out) and iat is optional, hence both
	// checks. Default DefaultMaxLifetime; at most MaxMaxLifetime, and it
	// cannot be turned off.
	MaxLifetime time.Duration
	// Now is the clock; default time.Now.
	Now func() time.Time
	// HTTPClient fetches JWKSURL. Default: a client that refuses
	// redirects off https.
	HTTPClient *http.Client
	// Logger receives refresh warnings; nil discards.
	Logger *slog.Logger
	// CacheSize bounds the cache of verified signatures (agents reuse an
	// assertion for many calls, and an Ed25519 verification costs more
	// than the rest of the intake's checks together); default
	// DefaultCacheSize, negative disables it. Only the signature is
	// cached: every use still checks exp, nbf, iss and aud against the
	// clock, and a change of the key set empties the cache.
	CacheSize int
}

// DefaultCacheSize is Config.CacheSize's default.
const DefaultCacheSize = 4096

func (c *Config) setDefaults() {
	if c.Audience == "" {
		c.Audience = DefaultAudience
	}
	if c.Refresh == 0 {
		c.Refresh = DefaultRefresh
	}
	if c.MaxStale == 0 {
		c.MaxStale = DefaultMaxStale
	}
	if c.Skew == 0 {
		c.Skew = DefaultSkew
	}
	if c.MaxLifetime == 0 {
		c.MaxLifetime = DefaultMaxLifetime
	}
	if c.Now == nil {
		c.Now = time.Now
	}
	if c.Logger == nil {
		c.Logger = slog.New(slog.DiscardHandler)
	}
	if c.CacheSize == 0 {
		c.CacheSize = DefaultCacheSize
	}
	if c.HTTPClient == nil {
		c.HTTPClient = &http.Client{
			Timeout: FetchTimeout,
			CheckRedirect: func(req *http.Request, via []*http.Request) error {
				if len(via) >= 5 {
					return errors.New("too many redirects")
				}
				return checkJWKSURL(req.URL)
			},
		}
	}
}

func (c *Config) validate() error {
	if c.Issuer == "" {
		return errors.New("identity: no issuer configured")
	}
	sources := 0
	for _, set := range []bool{c.JWKSFile != "", c.JWKSURL != "", c.Keys != nil} {
		if set {
			sources++
		}
	}
	if sources != 1 {
		return errors.New("identity: configure exactly one of JWKSFile, JWKSURL and Keys")
	}
	if c.JWKSURL != "" {
		u, err := url.Parse(c.JWKSURL)
		if err != nil {
			return errors.New("identity: JWKSURL is not a url")
		}
		if err := checkJWKSURL(u); err != nil {
			return fmt.Errorf("identity: %v", err)
		}
	}
	if c.Refresh < 0 {
		return errors.New("identity: negative Refresh")
	}
	if c.Skew < 0 || c.Skew > MaxSkew {
		return fmt.Errorf("identity: Skew must be between 0 and %s", MaxSkew)
	}
	if c.MaxLifetime < 0 || c.MaxLifetime > MaxMaxLifetime {
		return fmt.Errorf("identity: MaxLifetime must be between 0 and %s", MaxMaxLifetime)
	}
	return nil
}

// checkJWKSURL allows https, and http to loopback only: keys fetched in
// clear text could be swapped by anyone on the path.
func checkJWKSURL(u *url.URL) error {
	switch u.Scheme {
	case "https":
		return nil
	case "http":
		host := u.Hostname()
		if ip := net.ParseIP(host); host == "localhost" || ip != nil && ip.IsLoopback() {
			return nil
		}
	}
	return errors.New("jwks url must be https (http only on loopback)")
}

// Verifier verifies assertions. It is safe for concurrent use.
type Verifier struct {
	cfg    Config
	source string // for logs: the file path or the URL without query
	keys   atomic.Pointer[token.KeySet]

	// mu serialises refreshes and guards the two times.
	mu          sync.Mutex
	lastAttempt time.Time
	lastEarly   time.Time
	// loadedAt is when the last refresh that loaded the keys started
	// (nil before the first), stored after the keys: an unknown kid is
	// refused for good only against keys loaded after it first came
	// (missed).
	loadedAt atomic.Pointer[time.Time]
	missed   missedKids
	// failingSince is when refreshes started failing, nil while the
	// last one succeeded: a time.Time, whose monotonic reading (from
	// time.Now) a step of the wall clock does not move.
	failingSince atomic.Pointer[time.Time]

	cache verifiedCache
}

// verifiedCache holds the claims of assertions whose signature verified,
// by the sha256 of the assertion, for one key set.
type verifiedCache struct {
	mu   sync.Mutex
	keys *token.KeySet
	m    map[[sha256.Size]byte]Claims
}

func (c *verifiedCache) get(sum [sha256.Size]byte, keys *token.KeySet) (Claims, bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.keys != keys {
		return Claims{}, false
	}
	cl, ok := c.m[sum]
	return cl, ok
}

func (c *verifiedCache) put(sum [sha256.Size]byte, keys *token.KeySet, cl Claims, size int) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.keys != keys || len(c.m) >= size {
		// A new key set, or full: start again rather than track ages;
		// the working set of live assertions refills it at once.
		c.keys, c.m = keys, make(map[[sha256.Size]byte]Claims, min(size, 1024))
	}
	c.m[sum] = cl
}

// New returns a Verifier with its keys loaded once; it fails if the source
// cannot be read or holds no usable key.
func New(ctx context.Context, cfg Config) (*Verifier, error) {
	cfg.setDefaults()
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	v := &Verifier{cfg: cfg}
	switch {
	case cfg.JWKSFile != "":
		v.source = cfg.JWKSFile
	case cfg.JWKSURL != "":
		u, _ := url.Parse(cfg.JWKSURL) // validated
		v.source = (&url.URL{Scheme: u.Scheme, Host: u.Host, Path: u.Path}).String()
	default:
		v.source = "static"
	}
	started := cfg.Now()
	v.lastAttempt = started
	set, err := v.load(ctx)
	if err != nil {
		return nil, fmt.Errorf("identity: load keys from %s: %v", v.source, err)
	}
	v.keys.Store(set)
	v.loadedAt.Store(&started)
	return v, nil
}

// Keys returns the key set in use.
func (v *Verifier) Keys() *token.KeySet { return v.keys.Load() }

// Verify verifies assertion and returns the identity it asserts. Errors
// are *token.Error: ReasonMissingAssertion for an empty assertion, a token
// reason for anything wrong with the token or its claims,
// ReasonLifetimeTooLong for one valid longer than Config.MaxLifetime, and
// token.ReasonMissingClaim when sub, tenant or act is absent. One that
// only a time bound refuses is wrapped in a *LapsedError, which says
// whom it proves. ctx bounds a key refresh this call may perform.
func (v *Verifier) Verify(ctx context.Context, assertion string) (Identity, error) {
	id, _, err := v.VerifyUntil(ctx, assertion)
	return id, err
}

// VerifyUntil is Verify, and also returns when the assertion expires: a
// session built on it (the console's) must end then.
func (v *Verifier) VerifyUntil(ctx context.Context, assertion string) (Identity, time.Time, error) {
	c, err := v.claims(ctx, assertion)
	if err != nil {
		return Identity{}, time.Time{}, err
	}
	var exp time.Time
	if c.ExpiresAt != nil {
		exp = c.ExpiresAt.Time
	}
	return identityOf(c), exp, nil
}

// claims verifies assertion and returns its claims.
func (v *Verifier) claims(ctx context.Context, assertion string) (Claims, error) {
	if assertion == "" {
		return Claims{}, &token.Error{Reason: ReasonMissingAssertion, Detail: "the envelope carries no assertion"}
	}
	v.maybeRefresh(ctx)
	if err := v.stale(); err != nil {
		return Claims{}, err
	}
	set := v.keys.Load()
	var (
		sum    [sha256.Size]byte
		c      Claims
		err    error
		cached bool
	)
	if v.cfg.CacheSize > 0 {
		sum = sha256.Sum256([]byte(assertion))
		c, cached = v.cache.get(sum, set)
	}
	if !cached {
		var h token.Header
		c, h, err = v.verify(assertion, set)
		if token.ReasonOf(err) == token.ReasonUnknownKID {
			first := v.missed.first(h.Kid, v.cfg.Now())
			next := v.refreshEarly(ctx)
			// Before the keys: a refresh swaps them in first.
			loaded := v.loadedAt.Load()
			if now := v.keys.Load(); now != set {
				set = now
				c, _, err = v.verify(assertion, now)
			}
			if te, ok := errors.AsType[*token.Error](err); ok && te.Reason == token.ReasonUnknownKID &&
				v.cfg.Keys == nil && (loaded == nil || loaded.Before(first)) {
				// Not looked for in keys loaded since the kid first
				// came (the early refresh was spent on another kid
				// less than EarlyRefreshInterval ago, or failed): for
				// now, until the next one may run; unless its claims
				// refuse it whatever key signed it.
				if bad := v.badForGood(assertion); bad != "" {
					err = &token.Error{Reason: te.Reason, Detail: fmt.Sprintf("%s, and its claims, read unverified, refuse it whatever key signed it (%s)", te.Detail, bad)}
				} else {
					after := max(next.Sub(v.cfg.Now()), time.Second)
					err = &ForNowError{RetryAfter: after, Err: &token.Error{Reason: te.Reason,
						Detail: fmt.Sprintf("%s, and the issuer's keys were not loaded again since it came (next in %s): send it again then", te.Detail, after.Round(time.Second))}}
				}
			}
		}
		if err != nil {
			return Claims{}, err
		}
		if v.cfg.CacheSize > 0 {
			v.cache.put(sum, set, c, v.cfg.CacheSize)
		}
	}
	if a, ok := v.otherRole(c.Audience); ok {
		return Claims{}, &token.Error{Reason: token.ReasonAudienceMismatch, Detail: fmt.Sprintf("aud names %s too, the audience of another role's assertions: an assertion for both is refused", a)}
	}
	now := v.cfg.Now()
	valid := c.Validate(now, v.cfg.Skew, v.cfg.Issuer, v.cfg.Audience)
	if valid != nil {
		switch token.ReasonOf(valid) {
		case token.ReasonIssuerMismatch, token.ReasonAudienceMismatch, token.ReasonMissingClaim:
			return Claims{}, valid
		}
	} else {
		valid = v.checkLifetime(c.Claims, now)
	}
	for _, m := range []struct{ name, value string }{{"sub", c.Subject}, {"tenant", c.Tenant}, {"act", c.Act.Subject}} {
		if m.value == "" {
			if valid != nil {
				return Claims{}, valid
			}
			return Claims{}, &token.Error{Reason: token.ReasonMissingClaim, Detail: "no " + m.name}
		}
	}
	if valid != nil {
		return Claims{}, v.lapsed(c, now, valid)
	}
	return c, nil
}

// otherRole returns the first of aud that is one of OtherAudiences.
func (v *Verifier) otherRole(aud token.Audience) (string, bool) {
	for _, a := range aud {
		if a != v.cfg.Audience && slices.Contains(v.cfg.OtherAudiences, a) {
			return a, true
		}
	}
	return "", false
}

// LapsedGrace is how far past the skew an assertion's time bounds may be
// for it still to name whom its envelope's refusal is filed under
// (LapsedError): one that expired on its way to the intake (a restart or
// a rebalance in between), or whose start the intake's clock has not
// reached yet, is refused where its sender and its tenant's operators can
// see it. One further off may be one pasted in a ticket (or one minted
// for much later, or for too long), and anyone holding it could file
// refusals under its tenant: its refusals go under the reserved tenant,
// as those of one that does not verify.
const LapsedGrace = 5 * time.Minute

// LapsedError is Verify's error for an assertion that verified (its
// signature, issuer, audience and claims) and that only its time bounds
// refuse now, by less than LapsedGrace past the skew: it expired, or is
// not valid yet. Identity is whom it proves, for filing the refusal, and
// for answering a copy of that user's own call its key already holds (a
// duplicate, which admits nothing); nothing else may act on it. Err is
// the *token.Error that refuses it.
type LapsedError struct {
	Identity Identity
	Err      error
	// Unproven: its lifetime is not known (no iat: exp alone bounds
	// nothing once past) or is longer than MaxLifetime, so that it may
	// be one pasted in a ticket long ago: its identity answers a copy of
	// a call, never files a refusal.
	Unproven bool
}

func (e *LapsedError) Error() string { return e.Err.Error() }

func (e *LapsedError) Unwrap() error { return e.Err }

// lapsed wraps err, which refuses the verified claims c at now for a time
// bound, in a *LapsedError when that bound is off by less than
// LapsedGrace past the skew; Unproven unless c carries iat and exp - iat
// is within Config.MaxLifetime.
func (v *Verifier) lapsed(c Claims, now time.Time, err error) error {
	bound := v.cfg.Skew + LapsedGrace
	switch token.ReasonOf(err) {
	case token.ReasonExpired:
		if !now.Before(c.ExpiresAt.Add(bound)) {
			return err
		}
	case token.ReasonNotYetValid:
		for _, t := range []*token.NumericDate{c.NotBefore, c.IssuedAt} {
			if t != nil && t.After(now.Add(bound)) {
				return err
			}
		}
	default:
		return err
	}
	// Minted for too long, or not known not to be: never proof enough to
	// file under.
	unproven := c.IssuedAt == nil || v.checkLifetime(c.Claims, now) != nil
	return &LapsedError{Identity: identityOf(c), Err: err, Unproven: unproven}
}

// identityOf is the identity verified claims c assert.
func identityOf(c Claims) Identity {
	// Roles is cloned: the claims may be the cache's, shared with every
	// later use of the same assertion.
	return Identity{User: c.Subject, Agent: c.Act.Subject, Tenant: c.Tenant, Purpose: c.Purpose, Roles: slices.Clone(c.Roles)}
}

// checkLifetime refuses claims valid for longer than MaxLifetime. It runs
// on every use, cached or not, since the bound on exp is relative to now.
// Validate has already required exp.
func (v *Verifier) checkLifetime(c token.Claims, now time.Time) error {
	limit := v.cfg.MaxLifetime
	if c.ExpiresAt.After(now.Add(limit + v.cfg.Skew)) {
		return &token.Error{Reason: ReasonLifetimeTooLong, Detail: fmt.Sprintf("exp is more than %s from now", limit)}
	}
	// Both times are the issuer's clock: no skew between them.
	if c.IssuedAt != nil && c.ExpiresAt.After(c.IssuedAt.Add(limit)) {
		return &token.Error{Reason: ReasonLifetimeTooLong, Detail: fmt.Sprintf("exp is more than %s after iat", limit)}
	}
	return nil
}

func (v *Verifier) verify(assertion string, set *token.KeySet) (Claims, token.Header, error) {
	var c Claims
	h, err := token.Verify(assertion, token.VerifyOptions{Keys: set, Type: TypeAssertion}, &c)
	return c, h, err
}

// maybeRefresh refreshes when Refresh has passed since the last attempt,
// unless a refresh is already running (then this call uses the current
// keys rather than wait).
func (v *Verifier) maybeRefresh(ctx context.Context) {
	if v.cfg.Keys != nil || !v.mu.TryLock() {
		return
	}
	now := v.cfg.Now()
	if now.Sub(v.lastAttempt) < v.cfg.Refresh {
		v.mu.Unlock()
		return
	}
	v.refreshUnlock(ctx, now)
}

// refreshEarly refreshes for an unknown kid, at most once per
// EarlyRefreshInterval, and returns when the next such refresh may run.
// It waits for a refresh already running, whose keys the caller then
// sees.
func (v *Verifier) refreshEarly(ctx context.Context) time.Time {
	if v.cfg.Keys != nil {
		return time.Time{}
	}
	v.mu.Lock()
	now := v.cfg.Now()
	if !v.lastEarly.IsZero() && now.Sub(v.lastEarly) < EarlyRefreshInterval {
		next := v.lastEarly.Add(EarlyRefreshInterval)
		v.mu.Unlock()
		return next
	}
	v.lastEarly = now
	v.refreshUnlock(ctx, now)
	return now.Add(EarlyRefreshInterval)
}

// badForGood is the reason assertion's claims, read unverified, would
// refuse it for good whatever key signed it (another issuer or audience,
// expired past what a lapsed assertion may be: LapsedGrace), "" if none:
// such an assertion is not told to come back once its kid is looked for.
// One that expired less long ago is: verified, it names whom its refusal
// is filed under, or the call it copies (LapsedError).
func (v *Verifier) badForGood(assertion string) string {
	var c Claims
	if err := token.Unverified(assertion, &c); err != nil {
		return token.ReasonOf(err)
	}
	now := v.cfg.Now()
	switch reason := token.ReasonOf(c.Validate(now, v.cfg.Skew, v.cfg.Issuer, v.cfg.Audience)); reason {
	case token.ReasonExpired:
		if c.ExpiresAt != nil && now.Before(c.ExpiresAt.Time.Add(v.cfg.Skew+LapsedGrace)) {
			return ""
		}
		return reason
	case token.ReasonIssuerMismatch, token.ReasonAudienceMismatch, token.ReasonMissingClaim:
		return reason
	}
	return ""
}

// maxMissedKids bounds missedKids: a flood of made-up kids empties it,
// and a kid it forgot is judged from its next arrival (for now, at
// worst a minute longer).
const maxMissedKids = 4096

// missedKids remembers when each kid none of the keys at hand held first
// came, so that every assertion under it is refused for good once keys
// loaded after that were searched, not only the one that arrived before
// the refresh. Kids are kept by their digest: a header's kid may be long.
type missedKids struct {
	mu sync.Mutex
	m  map[[sha256.Size]byte]time.Time
}

// first returns when kid first came, now if it is new.
func (k *missedKids) first(kid string, now time.Time) time.Time {
	sum := sha256.Sum256([]byte(kid))
	k.mu.Lock()
	defer k.mu.Unlock()
	if t, ok := k.m[sum]; ok {
		return t
	}
	if k.m == nil || len(k.m) >= maxMissedKids {
		k.m = make(map[[sha256.Size]byte]time.Time)
	}
	k.m[sum] = now
	return now
}

// refreshUnlock refreshes in a goroutine of its own, which unlocks v.mu
// (held by the caller) when done, and waits for it while ctx lasts. The
// refresh runs to its end, and a failure counts, whoever asked for it
// hung up: else callers that hang up at once (HTTP requests, probes),
// each taking the due refresh and aborting it, would keep keys the issuer
// withdrew in force, and never trip MaxStale.
func (v *Verifier) refreshUnlock(ctx context.Context, now time.Time) {
	done := make(chan struct{})
	go func() {
		defer close(done)
		defer v.mu.Unlock()
		v.refreshLocked(context.WithoutCancel(ctx), now)
	}()
	select {
	case <-done:
	case <-ctx.Done():
	}
}

// Err says why every assertion is refused now (the issuer's keys stale,
// ReasonKeysStale), nil otherwise: for readiness checks, since such a
// verifier refuses every call while its process otherwise serves. It
// refreshes the keys first when due, as a verification would: else a
// verifier no assertion reached since its source came back would stay
// stale, and its role unready, for good.
func (v *Verifier) Err(ctx context.Context) error {
	v.maybeRefresh(ctx)
	return v.stale()
}

// stale refuses every assertion once refreshes have failed for longer
// than MaxStale (an idle verifier's keys are old, not stale: its next
// refresh may well succeed).
func (v *Verifier) stale() error {
	since := v.failingSince.Load()
	if v.cfg.MaxStale < 0 || since == nil {
		return nil
	}
	if d := v.cfg.Now().Sub(*since); d > v.cfg.MaxStale {
		return &ForNowError{Err: &token.Error{Reason: ReasonKeysStale, Detail: fmt.Sprintf("the issuer's keys could not be loaded from %s for %s (more than %s): the keys at hand may include one the issuer withdrew", v.source, d.Round(time.Second), v.cfg.MaxStale)},
			RetryAfter: StaleRetryAfter}
	}
	return nil
}

// refreshLocked loads the keys and swaps them in; on failure it keeps the
// old ones and warns. v.mu must be held.
func (v *Verifier) refreshLocked(ctx context.Context, now time.Time) {
	v.lastAttempt = now
	set, err := v.load(ctx)
	if err != nil {
		v.failingSince.CompareAndSwap(nil, &now)
		v.cfg.Logger.Warn("jwks refresh failed, keeping the current keys",
			"jwks_source", v.source, "kids", v.keys.Load().IDs(), "err", err)
		return
	}
	v.failingSince.Store(nil)
	old := v.keys.Swap(set)
	v.loadedAt.Store(&now)
	if !bytes.Equal(old.JWKS(), set.JWKS()) {
		v.cfg.Logger.Info("jwks keys changed", "jwks_source", v.source, "kids", set.IDs())
	}
}

// load reads the configured source; an empty set is an error, so that a
// truncated or emptied JWKS never replaces working keys.
func (v *Verifier) load(ctx context.Context) (*token.KeySet, error) {
	var (
		data []byte
		err  error
	)
	switch {
	case v.cfg.Keys != nil:
		return v.cfg.Keys, nonEmpty(v.cfg.Keys)
	case v.cfg.JWKSFile != "":
		data, err = readFile(v.cfg.JWKSFile)
	default:
		data, err = v.fetch(ctx)
	}
	if err != nil {
		return nil, err
	}
	set, err := token.ParseJWKS(data)
	if err != nil {
		return nil, err
	}
	return set, nonEmpty(set)
}

func nonEmpty(s *token.KeySet) error {
	if s.Len() == 0 {
		return errors.New("no usable signing key")
	}
	return nil
}

func readFile(path string) ([]byte, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	return readCapped(f)
}

func readCapped(r io.Reader) ([]byte, error) {
	data, err := io.ReadAll(io.LimitReader(r, token.MaxJWKSBytes+1))
	if err != nil {
		return nil, err
	}
	if len(data) > token.MaxJWKSBytes {
		return nil, fmt.Errorf("jwks larger than %d bytes", token.MaxJWKSBytes)
	}
	return data, nil
}

func (v *Verifier) fetch(ctx context.Context) ([]byte, error) {
	ctx, cancel := context.WithTimeout(ctx, FetchTimeout)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, v.cfg.JWKSURL, nil)
	if err != nil {
		return nil, errors.New("invalid jwks request")
	}
	req.Header.Set("Accept", "application/jwk-set+json, application/json")
	resp, err := v.cfg.HTTPClient.Do(req)
	if err != nil {
		// *url.Error repeats the full URL, query included: keep the cause.
		var ue *url.Error
		if errors.As(err, &ue) {
			err = ue.Err
		}
		return nil, fmt.Errorf("fetch jwks: %v", err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, 4096))
		return nil, fmt.Errorf("fetch jwks: http status %d", resp.StatusCode)
	}
	return readCapped(resp.Body)
}

// String names the verifier's issuer and key source, never key material.
func (v *Verifier) String() string {
	return fmt.Sprintf("identity.Verifier{issuer:%q audience:%q source:%q kids:%q}",
		v.cfg.Issuer, v.cfg.Audience, v.source, v.keys.Load().IDs())
}

// GoString is String.
func (v *Verifier) GoString() string { return v.String() }

// Format prints String for every verb.
func (v *Verifier) Format(f fmt.State, verb rune) { _, _ = io.WriteString(f, v.String()) }

// LogValue implements slog.LogValuer.
func (v *Verifier) LogValue() slog.Value {
	return slog.GroupValue(slog.String("issuer", v.cfg.Issuer), slog.String("jwks_source", v.source))
}

// AssertionVerifier verifies an assertion; *Verifier is one.
type AssertionVerifier interface {
	Verify(ctx context.Context, assertion string) (Identity, error)
}

// ReasonMissingBearer is Authenticate's refusal for a request without an
// "Authorization: Bearer" assertion.
const ReasonMissingBearer = "missing_bearer"

// Authenticate verifies the assertion a request carries as
// "Authorization: Bearer <assertion>". On refusal it returns a
// machine-readable reason (ReasonMissingBearer, or the verifier's token
// reason) that never quotes the assertion or its claims.
func Authenticate(r *http.Request, v AssertionVerifier) (Identity, string, error) {
	scheme, assertion, ok := strings.Cut(r.Header.Get("Authorization"), " ")
	assertion = strings.TrimSpace(assertion)
	if !ok || !strings.EqualFold(scheme, "Bearer") || assertion == "" {
		return Identity{}, ReasonMissingBearer, errors.New("identity: no bearer assertion")
	}
	return VerifyReason(r.Context(), v, assertion)
}

// VerifyReason is v.Verify(assertion), with the reason of a refusal
// ("expired", "bad_signature", ...; "invalid" when the error names
// none), for an answer that names it, never the assertion.
func VerifyReason(ctx context.Context, v AssertionVerifier, assertion string) (Identity, string, error) {
	id, err := v.Verify(ctx, assertion)
	if err != nil {
		reason := token.ReasonOf(err)
		if reason == "" {
			reason = "invalid"
		}
		return Identity{}, reason, err
	}
	return id, "", nil
}

// Require wraps next so that it runs only for a request whose bearer
// assertion v verifies; any other request is answered 401 with
// {"error": {"code": "unauthenticated", "message": ...}} and a
// WWW-Authenticate challenge for realm; one refused for now only
// (ForNowError) is answered 503 keys_unavailable with Retry-After. who
// names the expected party in the message ("an approver", "an
// operator"). The refusal is logged with its reason only, never the
// assertion.
func Require(v AssertionVerifier, realm, who string, logger *slog.Logger, next func(http.ResponseWriter, *http.Request, Identity)) http.HandlerFunc {
	if logger == nil {
		logger = slog.New(slog.DiscardHandler)
	}
	return func(w http.ResponseWriter, r *http.Request) {
		id, reason, err := Authenticate(r, v)
		if err == nil {
			next(w, r, id)
			return
		}
		if after, ok := RetryAfter(err); ok {
			// Not judged now (ForNowError): refused 401, the assertion
			// would pass for bad.
			logger.Info("assertion not verifiable now", "realm", realm, "reason", reason, "retry_after", after)
			httpjson.SetRetryAfter(w, after)
			httpjson.Error(w, http.StatusServiceUnavailable, "keys_unavailable",
				who+"'s assertion cannot be verified here now ("+reason+"): the issuer's keys at hand cannot judge it; send it again after Retry-After")
			return
		}
		w.Header().Set("Content-Type", "application/json")
		w.Header().Set("X-Content-Type-Options", "nosniff")
		w.Header().Set("Cache-Control", "no-store")
		challenge, msg := "Bearer realm="+strconv.Quote(realm), who+" assertion is required as Authorization: Bearer"
		if reason != ReasonMissingBearer {
			logger.Info("assertion refused", "realm", realm, "reason", reason)
			challenge += `, error="invalid_token"`
			msg = who + "'s assertion was refused: " + reason
		}
		w.Header().Set("WWW-Authenticate", challenge)
		w.WriteHeader(http.StatusUnauthorized)
		_ = json.NewEncoder(w).Encode(map[string]map[string]string{"error": {"code": "unauthenticated", "message": msg}})
	}
}
