// Package tracing puts the ledger's work on a call into the agent's
// OpenTelemetry trace. The envelope's trace_id names the trace: a W3C
// trace id, or a whole traceparent (then the agent's span is the parent),
// or any other string, hashed to a trace id so that every call carrying it
// lands in one trace; a call without one is a trace of its own. The spans
// are exported over OTLP (NewProvider), and each request to a tool carries
// its span as a W3C traceparent, so that the tool's spans nest under it.
//
// Without a tracer nothing is exported, and Fallback still gives each
// request a well-formed traceparent in the call's trace.
package tracing

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"math/rand/v2"
	"strconv"
	"strings"

	"go.opentelemetry.io/otel/trace"
)

// HeaderTraceparent is the W3C Trace Context request header.
const HeaderTraceparent = "traceparent"

// TraceID is the trace an envelope's trace_id names for the call key.
func TraceID(envTraceID, key string) trace.TraceID {
	if id, ok := w3cTraceID(envTraceID); ok {
		return id
	}
	seed := envTraceID
	if seed == "" {
		seed = "call:" + key
	}
	var id trace.TraceID
	copy(id[:], derived(seed))
	return nonZeroTrace(id)
}

// remoteParent is the agent's span when the envelope's trace_id is a whole
// traceparent.
func remoteParent(envTraceID string) (trace.SpanContext, bool) {
	tid, ok := w3cTraceID(envTraceID)
	if !ok || len(envTraceID) != 55 {
		return trace.SpanContext{}, false
	}
	sid, err := trace.SpanIDFromHex(envTraceID[36:52])
	if err != nil {
		return trace.SpanContext{}, false
	}
	return trace.NewSpanContext(trace.SpanContextConfig{TraceID: tid, SpanID: sid, TraceFlags: trace.FlagsSampled, Remote: true}), true
}

// w3cTraceID returns the trace id that s is (32 lowercase hex digits, not
// all zero) or carries (a version 00 traceparent).
func w3cTraceID(s string) (trace.TraceID, bool) {
	if len(s) == 55 && strings.HasPrefix(s, "00-") && s[35] == '-' && s[52] == '-' {
		s = s[3:35]
	}
	if len(s) != 32 || strings.ToLower(s) != s {
		return trace.TraceID{}, false
	}
	id, err := trace.TraceIDFromHex(s)
	return id, err == nil
}

// derived is SHA-256(seed): the bytes ids are cut from.
func derived(seed string) []byte {
	sum := sha256.Sum256([]byte(seed))
	return sum[:]
}

func nonZeroTrace(id trace.TraceID) trace.TraceID {
	if !id.IsValid() {
		id[15] = 1
	}
	return id
}

func nonZeroSpan(id trace.SpanID) trace.SpanID {
	if !id.IsValid() {
		id[7] = 1
	}
	return id
}

// Fallback is the traceparent of one request of a call when no span is
// exported: the call's trace, and a span id derived from the key and the
// attempt (the same attempt sent again keeps it).
func Fallback(envTraceID, key string, attempt int) string {
	var sid trace.SpanID
	copy(sid[:], derived("span:"+key+"/"+strconv.Itoa(attempt)))
	return format(TraceID(envTraceID, key), nonZeroSpan(sid), trace.FlagsSampled)
}

// Traceparent formats sc as a W3C traceparent; "" for an invalid one.
func Traceparent(sc trace.SpanContext) string {
	if !sc.IsValid() {
		return ""
	}
	return format(sc.TraceID(), sc.SpanID(), sc.TraceFlags())
}

func format(tid trace.TraceID, sid trace.SpanID, flags trace.TraceFlags) string {
	return "00-" + tid.String() + "-" + sid.String() + "-" + hex.EncodeToString([]byte{byte(flags)})
}

// StartCall starts the span of the ledger's work on a call: a child of the
// span in ctx if there is one, else of the agent's span when the
// envelope's trace_id is a traceparent, else a root span in the call's
// trace (see IDGenerator). With a nil tracer it starts nothing and returns
// a no-op span.
func StartCall(ctx context.Context, tr trace.Tracer, name, envTraceID, key string, opts ...trace.SpanStartOption) (context.Context, trace.Span) {
	if tr == nil {
		return ctx, trace.SpanFromContext(context.Background())
	}
	if !trace.SpanContextFromContext(ctx).IsValid() {
		if parent, ok := remoteParent(envTraceID); ok {
			ctx = trace.ContextWithRemoteSpanContext(ctx, parent)
		} else {
			ctx = context.WithValue(ctx, wantTraceKey{}, TraceID(envTraceID, key))
		}
	}
	return tr.Start(ctx, name, opts...)
}

type wantTraceKey struct{}

// IDGenerator gives a root span started by StartCall the call's trace id
// (an SDK makes up a random one otherwise) and every span a random span
// id. Use it as the TracerProvider's ID generator (NewProvider does).
type IDGenerator struct{}

// NewIDs implements the SDK's IDGenerator.
func (IDGenerator) NewIDs(ctx context.Context) (trace.TraceID, trace.SpanID) {
	tid, ok := ctx.Value(wantTraceKey{}).(trace.TraceID)
	if !ok || !tid.IsValid() {
		for i := range tid {
			tid[i] = byte(rand.Uint32())
		}
		tid = nonZeroTrace(tid)
	}
	return tid, randomSpan()
}

// NewSpanID implements the SDK's IDGenerator.
func (IDGenerator) NewSpanID(context.Context, trace.TraceID) trace.SpanID { return randomSpan() }

func randomSpan() trace.SpanID {
	var sid trace.SpanID
	for i := range sid {
		sid[i] = byte(rand.Uint32())
	}
	return nonZeroSpan(sid)
}
