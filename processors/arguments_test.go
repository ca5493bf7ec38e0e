package processors_test

import (
	"strings"
	"testing"

	"github.com/toolcall-ledger/ledger/ledger"
	"github.com/toolcall-ledger/ledger/processors"
)

// TestVerifyArguments: stored arguments run only when they hash to the
// call's hash, whether they are held canonical (as the intake stores
// them) or spelled otherwise; a change of the arguments, or of the
// tenant, tool or version they were hashed under, never runs.
func TestVerifyArguments(t *testing.T) {
	t.Parallel()
	base := verifiedRecord(t)
	rec := func(args string) processors.Record {
		r := base
		r.Arguments = []byte(args)
		return r
	}
	for _, args := range []string{
		verifiedArguments,
		`{"order_id": "ord_1029", "currency": "AUD", "amount_cents": 4.5e3}`,
	} {
		if err := processors.VerifyArguments(rec(args)); err != nil {
			t.Errorf("processors.VerifyArguments(%s) = %v; want nil", args, err)
		}
	}
	other := func(f func(*processors.Record)) processors.Record {
		r := base
		f(&r)
		return r
	}
	for name, r := range map[string]processors.Record{
		"other amount":   rec(strings.Replace(verifiedArguments, "4500", "4501", 1)),
		"a member added": rec(`{"amount_cents":4500,"currency":"AUD","order_id":"ord_1029","x":1}`),
		"bytes appended": rec(verifiedArguments + `,"x":1`),
		"not JSON":       rec(`{"amount_cents":`),
		"other tenant":   other(func(r *processors.Record) { r.Key.TenantID = "t_other" }),
		"other tool":     other(func(r *processors.Record) { r.Tool = "refund_orders" }),
		"other version":  other(func(r *processors.Record) { r.ToolVersion = 4 }),
	} {
		if err := processors.VerifyArguments(r); err == nil {
			t.Errorf("%s: VerifyArguments = nil; want an error", name)
		}
	}
}

// TestVerifyArgumentsHashesCanonicalBytes: canonical arguments are
// checked without a decode (a decode and a canonical encoding allocate
// five times as much), and arguments longer than a decode takes are
// refused even when they hash right, as the decode refused them.
func TestVerifyArgumentsHashesCanonicalBytes(t *testing.T) {
	r := verifiedRecord(t)
	if n := testing.AllocsPerRun(100, func() { _ = processors.VerifyArguments(r) }); n > 8 {
		t.Errorf("VerifyArguments of canonical arguments: %.0f allocations; want the hash alone (5)", n)
	}
	long := `{"note":"` + strings.Repeat("x", ledger.DefaultMaxBytes) + `"}`
	hash, err := ledger.HashCanonicalArguments(r.Key.TenantID, r.Tool, r.ToolVersion, []byte(long))
	if err != nil {
		t.Fatal(err)
	}
	r.Arguments, r.ArgumentsHash = []byte(long), hash
	if err := processors.VerifyArguments(r); err == nil {
		t.Errorf("processors.VerifyArguments(%d bytes) = nil; want the decode's refusal", len(long))
	}
}

func BenchmarkVerifyArguments(b *testing.B) {
	r := verifiedRecord(b)
	b.ReportAllocs()
	for b.Loop() {
		if err := processors.VerifyArguments(r); err != nil {
			b.Fatal(err)
		}
	}
}

// verifiedArguments are a refund's arguments, canonical.
const verifiedArguments = `{"amount_cents":4500,"currency":"AUD","order_id":"ord_1029"}`

// verifiedRecord is a record holding verifiedArguments and their hash.
func verifiedRecord(tb testing.TB) processors.Record {
	tb.Helper()
	tree, err := ledger.Decode([]byte(verifiedArguments), ledger.Limits{})
	if err != nil {
		tb.Fatal(err)
	}
	hash, err := ledger.ArgumentsHash("t_acme", "refund_order", 3, tree)
	if err != nil {
		tb.Fatal(err)
	}
	return processors.Record{
		Key:  ledger.CallKey{TenantID: "t_acme", IdempotencyKey: "k1"},
		Tool: "refund_order", ToolVersion: 3, ArgumentsHash: hash, Arguments: []byte(verifiedArguments),
	}
}
