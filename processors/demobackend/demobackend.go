// Package demobackend is the set of downstream tools that `ledger dev`, the
// tests and the benchmarks call: a weather read (get_weather), two tools with
// native idempotency (create_ticket, refund_order, with a status lookup) and
// one without any (send_email).
//
// It sits outside the product on purpose. It is the witness that counts side
// effects where they happen, so that a test proves "exactly once" at the tool
// and not in the ledger's own tables (DESIGN.md §5: tests count effects at
// the tool). Every request that reaches a tool is recorded as an Effect: a new
// effect, a native replay (no new effect) or a read. Faults (latency, hangs,
// failures, an effect applied and then the connection dropped, huge or
// hostile answers) are set at runtime so that tests can drive the executor
// into every outcome.
//
// With Config.Credentials set, the backend is also the tool side of the
// per-call credential: every tool request and status lookup must carry the
// ledger's credential for exactly that tool, tenant and call, or it is
// refused with 401 and no effect, and the refusal is counted (Refusals).
// Each effect records the jti of the credential that caused it. A tool
// without idempotency (send_email) spends the credential with its effect
// (credentials.Verifier.Spend): the same request sent again, a leaked
// token replayed with its call's key and body, is refused 401 spent
// instead of applying the effect again, while one answered without an
// effect (a 429, a fault before the effect) is still accepted again.
//
// File map: demobackend.go (server, routes, request flow), auth.go
// (credential check, refusals), tools.go (the four tools), witness.go
// (effects, counts, journal), fault.go (fault injection).
package demobackend

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"log/slog"
	"net/http"
	"os"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/toolcall-ledger/ledger/processors/credentials"
)

// Request headers the backend reads. They are the ones processors/httptool
// sends.
const (
	HeaderIdempotencyKey = "Idempotency-Key"
	HeaderCallID         = "X-Ledger-Call-Id"
	HeaderTenant         = "X-Ledger-Tenant"
	HeaderAttempt        = "X-Ledger-Attempt"
	// HeaderReplayed is set to "true" on a native tool's answer that replays
	// an earlier one (no new effect), as Stripe's Idempotent-Replayed.
	HeaderReplayed = "Idempotent-Replayed"
	// HeaderNotApplied is set to "true" on a 503 that applied nothing
	// (the credential could not be checked): the ledger asks again
	// rather than take the effect for unknown.
	HeaderNotApplied = "X-Ledger-Not-Applied"
)

// maxBodyBytes bounds a tool request body; larger bodies get 413.
const maxBodyBytes = 1 << 20

// Config configures a Server. The zero value is a working backend.
type Config struct {
	// Logger receives one debug record per effect and errors about the
	// journal. Default: discard.
	Logger *slog.Logger
	// Now stamps effects. Default: time.Now.
	Now func() time.Time
	// Latency is added to every tool request (POST and status lookups)
	// before it is handled, on top of any fault latency; benchmarks use it to
	// model a real downstream. Default: 0.
	Latency time.Duration
	// JournalPath, when set, makes the server append every effect as one JSON
	// line (an Effect) to this file, so that a test can count effects across
	// processes (see ReadJournal). The file is created if missing and
	// appended to otherwise; it is not fsynced. If it cannot be opened or
	// written, tool requests answer 500 without applying any effect, so the
	// journal never misses an effect that happened. Open, rather than
	// New, also takes up the state that the journal's effects left.
	// Default: no journal.
	JournalPath string
	// Credentials, when set, verifies the per-call credential on every
	// tool request and status lookup (see auth.go): Authorization: Bearer
	// <token> for scope "tool::<name>", the X-Ledger-Tenant tenant, the
	// Idempotency-Key call (for a lookup, its idempotency_key parameter),
	// and Audience. Anything else is answered 401 {"error": "<reason>"}
	// without an effect (503 keys_unavailable if the verifier cannot get
	// the keys). A tool without idempotency spends the credential with
	// its effect, in this verifier: presented again, it is refused 401
	// spent. Default: nil, no verification.
	Credentials *credentials.Verifier
	// Audience is the backend's audience, the aud its credentials must
	// carry; it overrides the verifier's own. Default: DefaultAudience.
	Audience string
	// BackendSecrets, by tool, are long-lived secrets a tool demands in
	// the X-Backend-Secret header (as a third-party API demands its key)
	// on its calls and its status lookups alike: a request without the
	// right one is refused 401 backend_secret, without an effect.
	BackendSecrets map[string]string
	// IntrospectURL, when set with Credentials, is the ledger's RFC 7662
	// token introspection endpoint: every credential that verifies is
	// also asked about there, and one that is not active (revoked) is
	// refused with 401 revoked. Unreachable: 503, no effect.
	IntrospectURL string
	// HTTPClient reaches IntrospectURL; default a client of the
	// backend's own with a 2s timeout, which keeps as many connections
	// to the endpoint open as there are requests in flight (one
	// introspection per tool request: a pool of two, http.DefaultTransport's,
	// would dial and close a connection for most of them).
	HTTPClient *http.Client
	// IntrospectTransport, when set and HTTPClient is not, is the
	// transport of the backend's own introspection client instead of a
	// clone of http.DefaultTransport: TLS settings of the operator's
	// (client certificates, private CAs). The backend sizes its pool and
	// closes its idle connections.
	IntrospectTransport *http.Transport
}

// DefaultAudience is the demo backend's audience, as in the registry's
// backend.audience of the demo tools.
const DefaultAudience = "demo-backend"

// Server is the demo tool backend. It is safe for concurrent use. Create it
// with New and serve Handler; Close releases hanging requests and the
// journal.
type Server struct {
	logger   *slog.Logger
	now      func() time.Time
	latency  time.Duration
	verifier *credentials.Verifier
	// revocations asks the introspection endpoint (Config.IntrospectURL)
	// through client; nil without one.
	revocations credentials.Revocations
	client      *http.Client
	// own is the transport of the client New made (nil when
	// Config.HTTPClient was given); Close closes its idle connections.
	own            *http.Transport
	backendSecrets map[string]string
	versions       map[string]int64 // by "<tenant>/<resource>"; guarded by mu
	audience       string

	// done is closed by Close; it releases requests held by a Hang fault or
	// a latency so that a test server can shut down.
	done      chan struct{}
	closeOnce sync.Once

	requests atomic.Int64

	mu         sync.Mutex
	seq        int64
	effects    []Effect
	refusals   []Refusal
	counters   map[string]int64         // per tool: the n in tkt_<n>, rf_<n>, msg_<n>
	stored     map[dedupeKey]storedCall // native tools: first answer per key
	faults     map[string]*faultState
	journal    *os.File
	journalErr error
}

// dedupeKey scopes a native tool's idempotency key by tenant, as the ledger
// scopes its calls: two tenants with the same key are two effects.
type dedupeKey struct {
	tool, tenant, key string
}

// storedCall is the first answer to a key, replayed to later requests.
type storedCall struct {
	argsHash string
	body     []byte
}

// introspectConns is how many idle connections to the introspection
// endpoint the backend's own client keeps: more than the requests a
// ledger has in flight to one backend (its executors' bulkheads).
const introspectConns = 256

// New returns a Server. If cfg.JournalPath cannot be opened the error is
// logged and every tool request answers 500 without an effect (see
// Config.JournalPath).
func New(cfg Config) *Server {
	s := &Server{
		logger:         cfg.Logger,
		now:            cfg.Now,
		latency:        cfg.Latency,
		verifier:       cfg.Credentials,
		backendSecrets: cfg.BackendSecrets,
		client:         cfg.HTTPClient,
		audience:       cfg.Audience,
		done:           make(chan struct{}),
		counters:       make(map[string]int64),
		versions:       make(map[string]int64),
		stored:         make(map[dedupeKey]storedCall),
		faults:         make(map[string]*faultState),
	}
	if s.logger == nil {
		s.logger = slog.New(slog.DiscardHandler)
	}
	if s.now == nil {
		s.now = time.Now
	}
	if s.audience == "" {
		s.audience = DefaultAudience
	}
	if s.client == nil && cfg.IntrospectURL != "" {
		// http.DefaultTransport's settings (proxy from the environment,
		// HTTP/2, handshake timeouts), with a pool to match.
		s.own = cfg.IntrospectTransport
		if s.own == nil {
			s.own = http.DefaultTransport.(*http.Transport).Clone()
		}
		s.own.MaxIdleConns, s.own.MaxIdleConnsPerHost = introspectConns, introspectConns
		s.client = &http.Client{Timeout: 2 * time.Second, Transport: s.own}
	}
	if cfg.IntrospectURL != "" {
		s.revocations = &credentials.Introspector{URL: cfg.IntrospectURL, Client: s.client}
	}
	if cfg.JournalPath != "" {
		f, err := os.OpenFile(cfg.JournalPath, os.O_WRONLY|os.O_APPEND|os.O_CREATE, 0o644)
		if err != nil {
			s.logger.Error("open effect journal", "path", cfg.JournalPath, "err", err)
			s.journalErr = err
		}
		s.journal = f
	}
	return s
}

// Open is New, on a backend that remembers what it did before: with
// cfg.JournalPath, the effects already in the journal are its state, as a
// real tool keeps its own: a native tool's key applied before a restart
// is answered with its first answer (replayed, or by its status lookup)
// instead of applied again, tickets and refunds go on numbering after
// the last, and resources keep their versions. The witness (Effects,
// GET /effects) starts empty: the journal holds every line. For one
// backend per journal: backends sharing one (ReadJournal's case) would
// each take up the others' effects when they start, and not those made
// after. A journal that cannot be read is an error; a missing one is an
// empty one; a last line cut short (a full disk, a crash before the
// write reached it) is cut off, so that the next line starts whole.
// Lines from before effects carried their answers and resources restore
// the numbering alone.
func Open(cfg Config) (*Server, error) {
	var effects []Effect
	if cfg.JournalPath != "" {
		if err := cutTornLine(cfg.JournalPath); err != nil {
			return nil, fmt.Errorf("demo backend: take up its journal: %w", err)
		}
		var err error
		effects, err = ReadJournal(cfg.JournalPath)
		if err != nil && !errors.Is(err, fs.ErrNotExist) {
			return nil, fmt.Errorf("demo backend: take up its journal: %w", err)
		}
	}
	s := New(cfg)
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, ef := range effects {
		s.seq = max(s.seq, ef.Seq)
		t, ok := toolNamed(ef.Tool)
		if !ok || ef.Replay || t.kind == kindRead {
			continue
		}
		// As apply counts them.
		s.counters[t.name]++
		if t.kind == kindNative && ef.Result != nil {
			s.stored[dedupeKey{tool: t.name, tenant: ef.TenantID, key: ef.IdempotencyKey}] = storedCall{argsHash: ef.ArgsHash, body: ef.Result}
		}
		if ef.Resource != "" {
			s.versions[ef.TenantID+"/"+ef.Resource]++
		}
	}
	return s, nil
}

// cutTornLine truncates the file at path after its last newline: a line
// written only in part is no effect (ReadJournal skips it), and lines
// appended after it would run on from it and break the file for every
// later reader. A missing file is left missing.
func cutTornLine(path string) error {
	b, err := os.ReadFile(path)
	if errors.Is(err, fs.ErrNotExist) || err == nil && (len(b) == 0 || b[len(b)-1] == '\n') {
		return nil
	}
	if err != nil {
		return err
	}
	return os.Truncate(path, int64(bytes.LastIndexByte(b, '\n')+1))
}

// Close releases requests held by a Hang fault or a latency, and closes the
// journal. It does not stop an http.Server serving Handler; the caller owns
// that. Close is idempotent.
func (s *Server) Close() error {
	var err error
	s.closeOnce.Do(func() {
		close(s.done)
		if s.own != nil {
			s.own.CloseIdleConnections()
		}
		s.mu.Lock()
		defer s.mu.Unlock()
		if s.journal != nil {
			err = s.journal.Close()
			s.journal = nil
			s.journalErr = errors.New("journal closed")
		}
	})
	return err
}

// Handler returns the backend's routes:
//
//	POST /tools/{tool}                        run a tool (Idempotency-Key required)
//	GET  /tools/{tool}/status?idempotency_key=K  status lookup of a native tool
//	GET  /effects                             the witness, as a JSON array of Effect
//	GET  /healthz                             liveness
//
// Every other path answers 404 with a JSON error.
func (s *Server) Handler() http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("POST /tools/{tool}", s.handleTool)
	mux.HandleFunc("GET /tools/{tool}/status", s.handleStatus)
	mux.HandleFunc("GET /effects", s.handleEffects)
	mux.HandleFunc("GET /resource_version", s.handleResourceVersion)
	mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, _ *http.Request) {
		writeJSON(w, http.StatusOK, map[string]string{"status": "ok"})
	})
	mux.HandleFunc("/", func(w http.ResponseWriter, r *http.Request) {
		writeError(w, http.StatusNotFound, "not_found", "no route for "+r.Method+" "+r.URL.Path)
	})
	return mux
}

// callMeta is what the ledger's headers say about a request.
type callMeta struct {
	key, callID, tenant string
	attempt             int
	traceparent         string    // the W3C trace context the request carried
	jti                 string    // of the verified credential; "" without verification
	issued              time.Time // the verified credential's iat
	received            time.Time // when the request reached the handler
	// ifMatch is the If-Match header: the version (an entity tag) the
	// caller expects the call's resource at.
	ifMatch string
	// cred is the verified credential, which the effect of a tool
	// without idempotency spends; zero without verification.
	cred credentials.Claims
}

func metaOf(r *http.Request) callMeta {
	// A missing or malformed attempt is recorded as 0: the witness records
	// what arrived, it does not police the ledger's headers.
	attempt, _ := strconv.Atoi(r.Header.Get(HeaderAttempt))
	return callMeta{
		ifMatch: r.Header.Get("If-Match"),
		key:     r.Header.Get(HeaderIdempotencyKey),
		callID:  r.Header.Get(HeaderCallID),
		tenant:  r.Header.Get(HeaderTenant),
		attempt: attempt,
		// traceparent is W3C's header name; the backend does not import
		// the client's package.
		traceparent: r.Header.Get("traceparent"),
	}
}

func (s *Server) handleTool(w http.ResponseWriter, r *http.Request) {
	received := s.now()
	s.requests.Add(1)
	ctx := r.Context()
	t, ok := toolNamed(r.PathValue("tool"))
	if !ok {
		writeError(w, http.StatusNotFound, "unknown_tool", "no tool named "+strconv.Quote(r.PathValue("tool")))
		return
	}
	meta := metaOf(r)
	if meta.key == "" {
		writeError(w, http.StatusBadRequest, "missing_idempotency_key", "the Idempotency-Key header is required")
		return
	}
	// Authenticate before the body is read or any fault applies: a
	// refused request costs nothing and changes nothing.
	claims, ok := s.authorize(w, r, t.name, meta.tenant, meta.key)
	if !ok {
		return
	}
	if !s.backendSecretOK(w, r, t.name, meta.tenant, meta.key) {
		return
	}
	meta.jti, meta.issued, meta.received, meta.cred = claims.JTI, claims.IssuedAt, received, claims
	body, err := io.ReadAll(http.MaxBytesReader(w, r.Body, maxBodyBytes))
	if err != nil {
		if _, tooBig := errors.AsType[*http.MaxBytesError](err); tooBig {
			writeError(w, http.StatusRequestEntityTooLarge, "body_too_large", "the body exceeds 1 MiB")
			return
		}
		writeError(w, http.StatusBadRequest, "unreadable_body", "the body could not be read")
		return
	}
	if !s.bodyOK(w, claims, body, t.name, meta.tenant, meta.key) {
		return
	}

	f := s.takeFault(t.name, meta.tenant)
	if !s.hold(ctx, w, s.latency+f.Latency, f.Hang) {
		return // the caller gave up or the server is closing: nothing applied
	}
	if f.FailStatus != 0 {
		writeError(w, f.FailStatus, "injected_fault", "fault injected before apply; no effect")
		return
	}
	if !json.Valid(body) {
		writeError(w, http.StatusBadRequest, "invalid_json", "the body is not valid JSON")
		return
	}
	build, err := t.parse(body)
	if err != nil {
		writeError(w, http.StatusBadRequest, "invalid_arguments", err.Error())
		return
	}

	out, err := s.apply(t, meta, body, build)
	if err != nil {
		switch {
		case credentials.ReasonOf(err) != "":
			// Spent by another presentation of the credential that
			// applied first (401 spent).
			s.refuseCredential(w, t.name, meta.tenant, meta.key, false, err)
		case errors.Is(err, errKeyReused):
			writeError(w, http.StatusConflict, "idempotency_key_reused", "the key was used with a different body")
		case errors.Is(err, errResourceChanged):
			writeError(w, http.StatusPreconditionFailed, "resource_changed", "the resource is not at the version If-Match names; nothing applied")
		default:
			writeError(w, http.StatusInternalServerError, "journal_unavailable", "the effect journal cannot be written; nothing applied")
		}
		return
	}
	switch {
	case f.ApplyThenDrop:
		drop(w)
		return
	case f.ApplyThenFail != 0:
		writeError(w, f.ApplyThenFail, "injected_fault_after_apply", "fault injected after the effect was applied")
		return
	case f.HugeBody > 0:
		writeHuge(w, f.HugeBody)
		return
	case f.Body != nil:
		writeRaw(w, http.StatusOK, f.Body)
		return
	}
	if out.replay {
		w.Header().Set(HeaderReplayed, "true")
	}
	writeRaw(w, http.StatusOK, out.body)
}

func (s *Server) handleStatus(w http.ResponseWriter, r *http.Request) {
	s.requests.Add(1)
	ctx := r.Context()
	t, ok := toolNamed(r.PathValue("tool"))
	if !ok {
		writeError(w, http.StatusNotFound, "unknown_tool", "no tool named "+strconv.Quote(r.PathValue("tool")))
		return
	}
	if t.kind != kindNative {
		writeError(w, http.StatusNotFound, "no_status_lookup", t.name+" has no status lookup")
		return
	}
	key := r.URL.Query().Get("idempotency_key")
	if key == "" {
		writeError(w, http.StatusBadRequest, "missing_idempotency_key", "the idempotency_key query parameter is required")
		return
	}
	// A lookup reveals a call's result, so it needs that call's
	// credential, like the call itself.
	if _, ok := s.authorize(w, r, t.name, r.Header.Get(HeaderTenant), key); !ok {
		return
	}
	if !s.backendSecretOK(w, r, t.name, r.Header.Get(HeaderTenant), key) {
		return
	}
	f := s.takeFault(t.name+statusSuffix, r.Header.Get(HeaderTenant))
	if !s.hold(ctx, w, s.latency+f.Latency, f.Hang) {
		return
	}
	if f.FailStatus != 0 {
		writeError(w, f.FailStatus, "injected_fault", "fault injected on the status lookup")
		return
	}

	s.mu.Lock()
	st, found := s.stored[dedupeKey{tool: t.name, tenant: r.Header.Get(HeaderTenant), key: key}]
	s.mu.Unlock()
	if !found {
		writeJSON(w, http.StatusNotFound, map[string]string{"state": "not_found"})
		return
	}
	writeJSON(w, http.StatusOK, struct {
		State  string          `json:"state"`
		Result json.RawMessage `json:"result"`
	}{State: "applied", Result: st.body})
}

// handleEffects lists the effects, in order; ?key_contains= keeps those
// whose idempotency key contains it (a benchmark run's, by its run id),
// so that a long-lived backend does not send its whole history.
func (s *Server) handleEffects(w http.ResponseWriter, r *http.Request) {
	part := r.URL.Query().Get("key_contains")
	if part == "" {
		writeJSON(w, http.StatusOK, s.Effects())
		return
	}
	writeJSON(w, http.StatusOK, s.effectsWhere(func(ef *Effect) bool { return strings.Contains(ef.IdempotencyKey, part) }))
}

// errKeyReused: a native tool saw a known key with a different body.
var errKeyReused = errors.New("idempotency key reused with a different body")

// errResourceChanged: the call's resource is not at the version its
// If-Match names.
var errResourceChanged = errors.New("resource not at the version If-Match names")

// applied is the outcome of apply.
type applied struct {
	body   []byte
	replay bool
}

// apply runs the tool's effect (or its replay) and records it in the
// witness. For native tools the check of the key and the effect happen under
// one lock, so concurrent requests with one key apply exactly once. A tool
// without idempotency spends the request's credential (with a verifier)
// under that lock as it records the effect, so that one credential applies
// one effect however often its request is sent: every later presentation
// is refused spent (a credential error), by Verify or, for those verified
// at the same time, here.
func (s *Server) apply(t tool, meta callMeta, body []byte, build func(n int64) any) (applied, error) {
	sum := sha256.Sum256(body)
	argsHash := hex.EncodeToString(sum[:])
	ef := Effect{
		Tool:             t.name,
		IdempotencyKey:   meta.key,
		CallID:           meta.callID,
		TenantID:         meta.tenant,
		Attempt:          meta.attempt,
		ArgsHash:         argsHash,
		JTI:              meta.jti,
		CredentialIssued: meta.issued,
		Read:             t.kind == kindRead,
		Received:         meta.received,
		Traceparent:      meta.traceparent,
	}

	s.mu.Lock()
	defer s.mu.Unlock()
	dk := dedupeKey{tool: t.name, tenant: meta.tenant, key: meta.key}
	if t.kind == kindNative {
		if st, ok := s.stored[dk]; ok {
			if st.argsHash != argsHash {
				return applied{}, errKeyReused
			}
			ef.Replay = true
			if err := s.recordLocked(ef); err != nil {
				return applied{}, err
			}
			return applied{body: st.body, replay: true}, nil
		}
	}
	var res string
	if t.kind != kindRead {
		res = resourceOf(body)
	}
	if res != "" && meta.ifMatch != "" && meta.ifMatch != `"`+s.versionLocked(meta.tenant, res)+`"` {
		// Checked under the lock that applies: no effect on the
		// resource can come between.
		return applied{}, errResourceChanged
	}
	n := s.counters[t.name] + 1
	out, err := json.Marshal(build(n))
	if err != nil {
		// The tools build plain structs and maps; a failure is a bug here.
		panic("demobackend: marshal result: " + err.Error())
	}
	if t.kind == kindNative {
		ef.Result = out
	}
	ef.Resource = res
	if t.kind == kindNone && s.verifier != nil && s.journalErr == nil {
		// Right before the effect, after every refusal that applies
		// nothing (those the ledger sends again with this credential).
		// A journal write that fails after it leaves it spent: that 500
		// does not say nothing was applied (the line may be in part),
		// and a call that does not deduplicate is not sent again.
		if err := s.verifier.Spend(meta.cred); err != nil {
			return applied{}, err
		}
	}
	if err := s.recordLocked(ef); err != nil {
		return applied{}, err
	}
	if t.kind != kindRead {
		s.counters[t.name] = n
		if ef.Resource != "" {
			s.versions[meta.tenant+"/"+ef.Resource]++
		}
	}
	if t.kind == kindNative {
		s.stored[dk] = storedCall{argsHash: argsHash, body: out}
	}
	return applied{body: out}, nil
}

// hold delays a request by d, or forever when hang is set, and reports
// whether to go on. It stops early when the request's ctx ends (the caller
// gave up) or the server closes; the connection is then dropped without an
// answer, because returning from the handler would send an empty 200 that
// looks like success.
func (s *Server) hold(ctx context.Context, w http.ResponseWriter, d time.Duration, hang bool) bool {
	var timeout <-chan time.Time
	switch {
	case hang:
		// timeout stays nil: only ctx or Close end the wait.
	case d > 0:
		t := time.NewTimer(d)
		defer t.Stop()
		timeout = t.C
	default:
		return true
	}
	select {
	case <-timeout:
		return true
	case <-ctx.Done():
	case <-s.done:
	}
	drop(w)
	return false
}

// drop closes the connection without an answer. After an applied effect it
// is the case where the caller cannot know whether the effect happened.
func drop(w http.ResponseWriter) {
	conn, _, err := http.NewResponseController(w).Hijack()
	if err != nil {
		// HTTP/2 cannot hijack; aborting the handler resets the stream
		// without an answer, which is the same thing for the caller.
		panic(http.ErrAbortHandler)
	}
	conn.Close()
}

// apiError is the JSON body of every error answer.
type apiError struct {
	Error   string `json:"error"`
	Message string `json:"message"`
}

func writeError(w http.ResponseWriter, status int, code, msg string) {
	writeJSON(w, status, apiError{Error: code, Message: msg})
}

func writeJSON(w http.ResponseWriter, status int, v any) {
	b, err := json.Marshal(v)
	if err != nil {
		panic("demobackend: marshal answer: " + err.Error())
	}
	writeRaw(w, status, b)
}

func writeRaw(w http.ResponseWriter, status int, b []byte) {
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Content-Length", strconv.Itoa(len(b)))
	w.WriteHeader(status)
	// A write error means the caller went away; there is nobody to tell.
	_, _ = w.Write(b)
}

// handleResourceVersion answers a resource's version for the tenant: it
// grows with every effect applied to it (calls whose arguments name it as
// order_id), so an approval can tell that the order changed since.
func (s *Server) handleResourceVersion(w http.ResponseWriter, r *http.Request) {
	res := r.URL.Query().Get("resource")
	if res == "" {
		writeError(w, http.StatusBadRequest, "missing_resource", "resource is required")
		return
	}
	s.mu.Lock()
	v := s.versionLocked(r.Header.Get(HeaderTenant), res)
	s.mu.Unlock()
	w.Header().Set("Content-Type", "application/json")
	_ = json.NewEncoder(w).Encode(map[string]string{"version": v})
}

// versionLocked is tenant's resource's version as the version endpoint
// answers it ("v3"), and as If-Match names it, quoted. s.mu must be held.
func (s *Server) versionLocked(tenant, resource string) string {
	return "v" + strconv.FormatInt(s.versions[tenant+"/"+resource], 10)
}

// BumpResource changes a resource's version, as a change made outside the
// ledger would.
func (s *Server) BumpResource(tenant, resource string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.versions[tenant+"/"+resource]++
}

// resourceOf is the resource a call's arguments name (order_id), whose
// version its effect moves on; "" for none.
func resourceOf(body []byte) string {
	var args struct {
		OrderID string `json:"order_id"`
	}
	if json.Unmarshal(body, &args) != nil {
		return ""
	}
	return args.OrderID
}
