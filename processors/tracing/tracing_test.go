package tracing

import (
	"regexp"
	"testing"
)

var traceparentRE = regexp.MustCompile(`^00-([0-9a-f]{32})-([0-9a-f]{16})-01$`)

// parts splits a traceparent, failing the test unless it is well formed
// by W3C Trace Context (version 00, lowercase hex, ids not all zero).
func parts(t *testing.T, tp string) (trace, span string) {
	t.Helper()
	m := traceparentRE.FindStringSubmatch(tp)
	if m == nil {
		t.Fatalf("traceparent %q is not 00-<32 hex>-<16 hex>-01", tp)
	}
	if m[1] == "00000000000000000000000000000000" || m[2] == "0000000000000000" {
		t.Fatalf("traceparent %q has an all-zero id", tp)
	}
	return m[1], m[2]
}

func TestTraceparentKeepsAW3CTrace(t *testing.T) {
	const w3c = "4bf92f3577b34da6a3ce929d0e0e4736"
	for _, in := range []string{w3c, "00-" + w3c + "-00f067aa0ba902b7-01"} {
		trace, _ := parts(t, Fallback(in, "t_a:call_1", 1))
		if trace != w3c {
			t.Errorf("trace_id %q: trace %s, want %s", in, trace, w3c)
		}
	}
}

func TestTraceparentDerivesOtherTraces(t *testing.T) {
	a1, _ := parts(t, Fallback("tr_5c1e", "t_a:call_1", 1))
	a2, _ := parts(t, Fallback("tr_5c1e", "t_a:call_2", 1))
	b, _ := parts(t, Fallback("tr_other", "t_a:call_1", 1))
	if a1 != a2 {
		t.Errorf("two calls of trace_id tr_5c1e are in traces %s and %s; want one", a1, a2)
	}
	if a1 == b {
		t.Errorf("trace_ids tr_5c1e and tr_other share trace %s", a1)
	}
	// Not W3C: upper case, all zero, wrong length.
	for _, in := range []string{"4BF92F3577B34DA6A3CE929D0E0E4736", "00000000000000000000000000000000", "4bf92f35"} {
		if trace, _ := parts(t, Fallback(in, "k", 1)); trace == in {
			t.Errorf("trace_id %q taken as a W3C trace id", in)
		}
	}
	// Without a trace_id each call is its own trace.
	n1, _ := parts(t, Fallback("", "t_a:call_1", 1))
	n2, _ := parts(t, Fallback("", "t_a:call_2", 1))
	if n1 == n2 {
		t.Errorf("calls without trace_id share trace %s", n1)
	}
}

func TestTraceparentSpanPerAttempt(t *testing.T) {
	_, s1 := parts(t, Fallback("tr", "t_a:call_1", 1))
	_, s1again := parts(t, Fallback("tr", "t_a:call_1", 1))
	_, s2 := parts(t, Fallback("tr", "t_a:call_1", 2))
	_, other := parts(t, Fallback("tr", "t_a:call_2", 1))
	if s1 != s1again {
		t.Errorf("one attempt has spans %s and %s", s1, s1again)
	}
	if s1 == s2 || s1 == other {
		t.Errorf("spans %s (attempt 1), %s (attempt 2), %s (another call): want all different", s1, s2, other)
	}
}
