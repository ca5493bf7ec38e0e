package console

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"strconv"
	"time"

	"github.com/toolcall-ledger/ledger/ledger"
	"github.com/toolcall-ledger/ledger/ledger/httpjson"
)

// maxAnswerBytes bounds one API answer the console reads into memory.
const maxAnswerBytes = 64 << 20

// The API routes the console asks.
const (
	pathApprovals     = "/v1/approvals"
	pathControl       = "/v1/control"
	pathCompensations = "/v1/compensations"
	pathResolutions   = "/v1/resolutions"
	pathBlastRadius   = "/v1/blast-radius"
	pathOutcomes      = "/v1/outcomes"
	pathUnresolved    = "/v1/unresolved"
	pathTrace         = "/v1/trace/"
	pathCalls         = "/v1/calls/"
	pathHealth        = "/v1/health"
)

// headerRefusalsLimitReached, on a trace, says that it holds as many
// refused submissions under its key as the projection keeps (the
// earliest and the latest): those between may not be shown. It is
// httpapi.HeaderRefusalsLimitReached.
const headerRefusalsLimitReached = "X-Refusals-Limit-Reached"

// headerLimitReached, on a list of calls, says that it holds as many as
// it may (its limit): more match than it lists.
const headerLimitReached = "X-Limit-Reached"

// apiApprovalPath is the approval API's path of one approval.
func apiApprovalPath(id string) string { return pathApprovals + "/" + url.PathEscape(id) }

// apiTracePath is the trace API's path of one call's events.
func apiTracePath(tenant, key string) string {
	return pathTrace + url.PathEscape(tenant) + "/" + url.PathEscape(key)
}

// apiError is an API's refusal, as {"error": {"code", "message"}} says it.
type apiError struct {
	Status  int
	Code    string
	Message string
}

func (e *apiError) Error() string {
	return fmt.Sprintf("%s (%d): %s", e.Code, e.Status, e.Message)
}

// Is makes a service's own answer that an action may have been taken
// (its write failed, and could not be read back) count as the action's
// answer broken off: not a refusal, with the service's words.
func (e *apiError) Is(target error) bool {
	return target == errActionBrokenOff && e.Code == httpjson.CodeActionOutcomeUnknown
}

// describe renders err for a person: an API's refusal by its code and
// message, anything else as it is.
func describe(err error) string {
	if ae, ok := errors.AsType[*apiError](err); ok {
		return ae.Code + ": " + ae.Message
	}
	return err.Error()
}

// recorder is the in-memory ResponseWriter an API answers into. It keeps
// at most limit bytes of body.
type recorder struct {
	header   http.Header
	status   int
	body     bytes.Buffer
	limit    int
	overflow bool
}

func newRecorder(limit int) *recorder { return &recorder{header: make(http.Header), limit: limit} }

func (r *recorder) Header() http.Header { return r.header }

func (r *recorder) WriteHeader(code int) {
	if r.status == 0 {
		r.status = code
	}
}

func (r *recorder) Write(b []byte) (int, error) {
	r.WriteHeader(http.StatusOK)
	if room := r.limit - r.body.Len(); len(b) > room {
		r.overflow = true
		r.body.Write(b[:max(room, 0)])
		return 0, errors.New("console: API answer too large")
	}
	return r.body.Write(b)
}

// apiRequest builds the in-memory request for an API call on behalf of s:
// path is already escaped, the session's assertion goes as the bearer, and
// the client's address and host travel along for the API's logs.
func (c *Console) apiRequest(ctx context.Context, r *http.Request, s *session, method, path string, q url.Values, body any) (*http.Request, error) {
	target := path
	if len(q) > 0 {
		target += "?" + q.Encode()
	}
	var rd io.Reader
	if body != nil {
		b, err := json.Marshal(body)
		if err != nil {
			return nil, fmt.Errorf("encode %s body: %w", path, err)
		}
		rd = bytes.NewReader(b)
	}
	req, err := http.NewRequestWithContext(ctx, method, target, rd)
	if err != nil {
		return nil, fmt.Errorf("request %s: %w", path, err)
	}
	if req.Body == nil {
		// A server's handler may read the body of any request.
		req.Body = http.NoBody
	}
	req.Host = r.Host
	req.RemoteAddr = r.RemoteAddr
	req.RequestURI = target
	req.Header.Set("Authorization", "Bearer "+s.assertion)
	req.Header.Set("Accept", "application/json")
	req.Header.Set("User-Agent", "ledger-console")
	if body != nil {
		req.Header.Set("Content-Type", "application/json")
	}
	return req, nil
}

// call asks the API and decodes a 2xx answer into out (when not nil). It
// returns the status; a refusal is an *apiError.
func (c *Console) call(r *http.Request, s *session, method, path string, q url.Values, body, out any) (int, error) {
	status, _, err := c.callHeader(r, s, method, path, q, body, out)
	return status, err
}

// callHeader is call, which also returns the answer's headers, for an
// answer that says in them what it left out (headerRefusalsLimitReached);
// nil when it broke off.
func (c *Console) callHeader(r *http.Request, s *session, method, path string, q url.Values, body, out any) (int, http.Header, error) {
	req, err := c.apiRequest(r.Context(), r, s, method, path, q, body)
	if err != nil {
		return 0, nil, err
	}
	rec := newRecorder(maxAnswerBytes)
	if !serveAPI(c.cfg.API, rec, req) {
		if method != http.MethodGet {
			return http.StatusBadGateway, nil, errActionBrokenOff
		}
		return http.StatusBadGateway, nil, errBrokenOff
	}
	status := rec.status
	if status == 0 {
		status = http.StatusOK
	}
	if status < 200 || status > 299 {
		ref := refusal(status, rec.body.Bytes())
		if method != http.MethodGet && ref.Code == httpjson.CodeUpstreamUnavailable {
			// The proxy lost the service behind it, perhaps after the
			// service took the action: not a refusal.
			return status, rec.header, errActionBrokenOff
		}
		return status, rec.header, ref
	}
	if rec.overflow {
		return status, rec.header, fmt.Errorf("%s %s: the answer is larger than %d bytes", method, path, maxAnswerBytes)
	}
	if out != nil {
		if err := json.Unmarshal(rec.body.Bytes(), out); err != nil {
			return status, rec.header, fmt.Errorf("%s %s: the answer does not decode: %w", method, path, err)
		}
	}
	return status, rec.header, nil
}

// errBrokenOff is the refusal of an API answer that broke off;
// errActionBrokenOff that of an action's, which may have been taken.
var (
	errBrokenOff = &apiError{Status: http.StatusBadGateway, Code: "answer_broken_off",
		Message: "the API's answer broke off (the service behind it stopped mid-answer, or the answer was too large to pass on); try again"}
	errActionBrokenOff = &apiError{Status: http.StatusBadGateway, Code: httpjson.CodeActionOutcomeUnknown,
		Message: "the API's answer broke off after the action was sent: it may have been taken; look before trying again"}
)

// serveAPI has h answer r into w, and reports whether it answered whole:
// false when it aborted (http.ErrAbortHandler, which a reverse proxy
// raises when the service behind it breaks off, or when w refuses more),
// which would otherwise reset the browser's connection with no page and
// nothing logged.
func serveAPI(h http.Handler, w http.ResponseWriter, r *http.Request) (whole bool) {
	defer func() {
		if v := recover(); v != nil {
			if v != http.ErrAbortHandler {
				panic(v)
			}
			whole = false
		}
	}()
	h.ServeHTTP(w, r)
	return true
}

// refusal reads an API's error answer.
func refusal(status int, body []byte) *apiError {
	var e struct {
		Error struct {
			Code    string `json:"code"`
			Message string `json:"message"`
		} `json:"error"`
	}
	_ = json.Unmarshal(body, &e)
	ae := &apiError{Status: status, Code: e.Error.Code, Message: e.Error.Message}
	if ae.Code == "" {
		ae.Code = "http_" + strconv.Itoa(status)
	}
	if ae.Message == "" {
		ae.Message = http.StatusText(status)
	}
	return ae
}

// streamer passes a 200 answer straight through to the browser, with the
// headers start sets (given the API's, and the browser's to set), and
// keeps any other answer to read as a refusal.
type streamer struct {
	w       http.ResponseWriter
	start   func(api, h http.Header)
	header  http.Header
	status  int
	errBody bytes.Buffer
}

func (s *streamer) Header() http.Header { return s.header }

func (s *streamer) WriteHeader(code int) {
	if s.status != 0 {
		return
	}
	s.status = code
	if code == http.StatusOK {
		s.start(s.header, s.w.Header())
		s.w.WriteHeader(code)
	}
}

func (s *streamer) Write(b []byte) (int, error) {
	s.WriteHeader(http.StatusOK)
	if s.status == http.StatusOK {
		return s.w.Write(b)
	}
	if s.errBody.Len()+len(b) > 64<<10 {
		return 0, errors.New("console: API error answer too large")
	}
	return s.errBody.Write(b)
}

// Flush passes a flush on, so that a long CSV reaches the browser as it
// is written.
func (s *streamer) Flush() {
	if f, ok := s.w.(http.Flusher); ok && s.status == http.StatusOK {
		f.Flush()
	}
}

// Unwrap is the browser's writer, for http.ResponseController: the API's
// bound on writing its answer (httpapi's writeWithin) reaches the
// browser's connection. Without it the bound was dropped, and a client
// that did not read held a streamed CSV for as long as its connection.
func (s *streamer) Unwrap() http.ResponseWriter { return s.w }

// stream asks the API with GET and streams a 200 answer to w; it returns
// whether it did, and the refusal otherwise, with nothing written to w.
func (c *Console) stream(w http.ResponseWriter, r *http.Request, s *session, path string, q url.Values, start func(api, h http.Header)) error {
	req, err := c.apiRequest(r.Context(), r, s, http.MethodGet, path, q, nil)
	if err != nil {
		return err
	}
	st := &streamer{w: w, start: start, header: make(http.Header)}
	if !serveAPI(c.cfg.API, st, req) {
		if st.status == http.StatusOK {
			// Part of it went to the browser already: break its
			// answer off too, as a proxy would.
			panic(http.ErrAbortHandler)
		}
		return errBrokenOff
	}
	switch st.status {
	case 0:
		st.WriteHeader(http.StatusOK) // an empty answer
		return nil
	case http.StatusOK:
		return nil
	}
	return refusal(st.status, st.errBody.Bytes())
}

// The JSON shapes the console reads. They mirror the APIs' own types
// (processors/approvals.Approval, httpapi.CallView, control.Snapshot),
// which the console cannot import: projections never import processors.

// approval is GET /v1/approvals/{id}'s answer.
type approval struct {
	ID             string `json:"id"`
	TenantID       string `json:"tenant_id"`
	IdempotencyKey string `json:"idempotency_key"`
	CallID         string `json:"call_id"`
	Tool           string `json:"tool"`
	ToolVersion    int    `json:"tool_version"`
	Requester      struct {
		User       string   `json:"user"`
		Agent      string   `json:"agent"`
		Roles      []string `json:"roles"`
		RolesGiven bool     `json:"roles_given"`
	} `json:"requester"`
	ArgumentsHash string     `json:"arguments_hash"`
	PolicyVersion string     `json:"policy_version"`
	PolicyIDs     []string   `json:"policy_ids"`
	RequestedAt   time.Time  `json:"requested_at"`
	ExpiresAt     time.Time  `json:"expires_at"`
	State         string     `json:"state"`
	DecidedBy     string     `json:"decided_by"`
	DecidedAt     *time.Time `json:"decided_at"`
	Reason        string     `json:"reason"`
	CallStatus    string     `json:"call_status"`
	CallReason    string     `json:"call_reason"`
	Preview       struct {
		Tool         string          `json:"tool"`
		Description  string          `json:"description"`
		Effect       string          `json:"effect"`
		Risk         string          `json:"risk"`
		Resource     string          `json:"resource"`
		Arguments    json.RawMessage `json:"arguments"`
		Amount       string          `json:"amount"`
		Compensation string          `json:"compensation"`
	} `json:"preview"`
}

// approvalList is GET /v1/approvals' answer.
type approvalList struct {
	Approvals []approval `json:"approvals"`
	// More: the service's list stopped at its bound; others wait.
	More bool `json:"more"`
}

// callView is GET /v1/calls/{key}'s answer.
type callView struct {
	TenantID       string          `json:"tenant_id"`
	IdempotencyKey string          `json:"idempotency_key"`
	State          string          `json:"state"`
	Settled        bool            `json:"settled"`
	Events         []ledger.Event  `json:"events"`
	Result         json.RawMessage `json:"result"`
}

// controlSnapshot is GET /v1/control's answer.
type controlSnapshot struct {
	Freezes     []ledger.ControlAction `json:"freezes"`
	Revocations []ledger.ControlAction `json:"revocations"`
}

// compensationAnswer is POST /v1/compensations' answer.
type compensationAnswer struct {
	CompensationKey string         `json:"compensation_key"`
	Events          []ledger.Event `json:"events"`
}

// The bodies the console sends.
type (
	approveBody struct {
		ArgumentsHash string `json:"arguments_hash"`
	}
	rejectBody struct {
		Reason string `json:"reason"`
	}
	// toolBody names the tool (and tenant) of a freeze or an unfreeze.
	toolBody struct {
		Tool   string `json:"tool"`
		Tenant string `json:"tenant,omitempty"`
		Reason string `json:"reason"`
	}
	freezeBody struct {
		toolBody
		// AllowUnknownTool freezes a tool the control service's
		// registry does not hold, which it refuses (unknown_tool)
		// otherwise.
		AllowUnknownTool bool `json:"allow_unknown_tool,omitempty"`
	}
	unfreezeBody struct {
		toolBody
		FreezeAt *time.Time `json:"freeze_at,omitempty"`
	}
	revokeBody struct {
		JTI    string `json:"jti,omitempty"`
		Family string `json:"family,omitempty"`
		Reason string `json:"reason"`
	}
	compensateBody struct {
		TenantID       string `json:"tenant_id"`
		IdempotencyKey string `json:"idempotency_key"`
		Reason         string `json:"reason"`
	}
	resolveBody struct {
		TenantID       string `json:"tenant_id"`
		IdempotencyKey string `json:"idempotency_key"`
		As             string `json:"as"`
		Evidence       string `json:"evidence"`
		// CancelCompensation confirms a resolution as succeeded while
		// the reconciler's compensation of the call is pending.
		CancelCompensation bool `json:"cancel_compensation,omitempty"`
	}
)
