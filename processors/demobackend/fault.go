package demobackend

import (
	"bytes"
	"io"
	"net/http"
	"strconv"
	"time"
)

// Fault is a misbehaviour injected into one tool's route. Fields combine in
// the order a request meets them: Latency, then Hang, then FailStatus (no
// effect), then the tool runs, then ApplyThenDrop, ApplyThenFail, HugeBody
// or Body (the first one set wins).
type Fault struct {
	// Latency delays the request before it is handled (on top of
	// Config.Latency). A caller that gives up during the delay gets nothing
	// applied.
	Latency time.Duration
	// Hang: never answer and apply nothing, until the request's ctx is done
	// (the caller gave up) or the Server is closed.
	Hang bool
	// FailStatus, when non-zero, answers with this status without applying
	// the effect.
	FailStatus int
	// FailTimes limits the fault to the first N requests to the route after
	// SetFault; later requests are handled normally. 0 means every request
	// while the fault is set. It bounds the whole fault, not just FailStatus,
	// so {ApplyThenDrop: true, FailTimes: 1} drops one answer and then
	// behaves.
	FailTimes int
	// ApplyThenDrop applies the effect (or, for a native tool, its replay),
	// then closes the connection without an answer: the caller cannot tell
	// whether the effect happened.
	ApplyThenDrop bool
	// ApplyThenFail, when non-zero, applies the effect and then answers with
	// this status. A native tool still remembers the real answer, so a retry
	// with the same key replays it.
	ApplyThenFail int
	// HugeBody, when positive, applies the effect and then answers 200
	// with a valid JSON document of exactly HugeBody bytes (at least 14,
	// the smallest such document) instead of the tool's answer: a tool
	// that returns far more than anyone asked for. It is streamed, so the
	// backend never holds it.
	// A native tool still remembers (and replays) the real answer.
	HugeBody int
	// Body, when non-nil, applies the effect and then answers 200 with
	// these bytes verbatim, labelled application/json whatever they are:
	// invalid JSON, invalid UTF-8, control characters, or text that tries
	// to instruct whoever reads it (prompt injection). A native tool still
	// remembers (and replays) the real answer.
	Body []byte
}

// minHugeBody is the smallest HugeBody document: {"padding":""}.
const minHugeBody = len(`{"padding":""}`)

// writeHuge answers 200 with a JSON document of n bytes (at least
// minHugeBody), written in 32 KiB chunks whatever its size.
func writeHuge(w http.ResponseWriter, n int) {
	n = max(n, minHugeBody)
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Content-Length", strconv.Itoa(n))
	w.WriteHeader(http.StatusOK)
	chunk := bytes.Repeat([]byte("x"), 32<<10)
	// A write error means the caller stopped reading (it caps what it
	// reads); there is nobody to tell.
	if _, err := io.WriteString(w, `{"padding":"`); err != nil {
		return
	}
	for left := n - minHugeBody; left > 0; {
		k := min(left, len(chunk))
		if _, err := w.Write(chunk[:k]); err != nil {
			return
		}
		left -= k
	}
	_, _ = io.WriteString(w, `"}`)
}

// faultState is a Fault and how many requests it has hit.
type faultState struct {
	Fault
	hits int
}

// SetFault injects f into tool's route, replacing any earlier fault there
// and restarting its FailTimes count. tool is a tool name, or a tool name
// plus "/status" (e.g. "refund_order/status") to fault its status lookup;
// there only Latency, Hang, FailStatus and FailTimes apply.
func (s *Server) SetFault(tool string, f Fault) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.faults[tool] = &faultState{Fault: f}
}

// SetTenantFault injects f into tool's route for one tenant's requests
// only, the noisy neighbour a bulkhead must contain. A tenant's fault
// takes precedence over the route's fault set by SetFault.
func (s *Server) SetTenantFault(tool, tenant string, f Fault) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.faults[tenantRoute(tool, tenant)] = &faultState{Fault: f}
}

// tenantRoute is the fault key of one tenant's requests to route. NUL
// cannot occur in a tool name or a tenant header.
func tenantRoute(route, tenant string) string { return route + "\x00" + tenant }

// ClearFaults removes every fault.
func (s *Server) ClearFaults() {
	s.mu.Lock()
	defer s.mu.Unlock()
	clear(s.faults)
}

// takeFault returns the fault that applies to tenant's request to route
// (the zero Fault when none does) and counts the hit.
func (s *Server) takeFault(route, tenant string) Fault {
	s.mu.Lock()
	defer s.mu.Unlock()
	fs, ok := s.faults[tenantRoute(route, tenant)]
	if !ok {
		fs, ok = s.faults[route]
	}
	if !ok {
		return Fault{}
	}
	if fs.FailTimes > 0 && fs.hits >= fs.FailTimes {
		return Fault{}
	}
	fs.hits++
	return fs.Fault
}
