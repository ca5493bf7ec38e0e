package httptool

import (
	"crypto/sha256"
	"encoding/hex"
	"strconv"
	"strings"
)

// HeaderTraceparent is the W3C Trace Context header (traceparent) the
// ledger sends to tools, so that a tool's own spans join the agent's
// trace.
const HeaderTraceparent = "traceparent"

// Traceparent returns the W3C traceparent for one request made for a
// call: version 00, the call's trace, a span of its own, sampled.
//
// The trace is the envelope's trace_id when that is already a W3C trace id
// (32 lowercase hex digits, not all zero) or a whole traceparent;
// otherwise it is derived from the trace_id by hashing, so that every
// request of every call carrying that trace_id lands in one trace; a call
// without a trace_id is a trace of its own, derived from its idempotency
// key. The span id is derived from the idempotency key and the attempt:
// each attempt is its own span, and the same attempt sent again (a
// retried send of one attempt) keeps its span.
func Traceparent(traceID, idempotencyKey string, attempt int) string {
	trace := w3cTraceID(traceID)
	if trace == "" {
		seed := traceID
		if seed == "" {
			seed = "call:" + idempotencyKey
		}
		trace = derivedID(seed, 16)
	}
	span := derivedID("span:"+idempotencyKey+"/"+strconv.Itoa(attempt), 8)
	return "00-" + trace + "-" + span + "-01"
}

// w3cTraceID returns the W3C trace id that s is or carries, or "".
func w3cTraceID(s string) string {
	if len(s) == 55 && strings.HasPrefix(s, "00-") && s[35] == '-' && s[52] == '-' {
		s = s[3:35]
	}
	if len(s) != 32 || strings.Trim(s, "0") == "" {
		return ""
	}
	for i := 0; i < len(s); i++ {
		if c := s[i]; (c < '0' || c > '9') && (c < 'a' || c > 'f') {
			return ""
		}
	}
	return s
}

// derivedID is n bytes of SHA-256(seed), hex, never all zero (which W3C
// forbids).
func derivedID(seed string, n int) string {
	sum := sha256.Sum256([]byte(seed))
	id := sum[:n]
	if strings.Trim(hex.EncodeToString(id), "0") == "" {
		id[n-1] = 1
	}
	return hex.EncodeToString(id)
}
