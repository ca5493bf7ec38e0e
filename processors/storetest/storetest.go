// Package storetest is the contract suite of processors.Store: the same
// tests, run against every implementation (processors/pgstore on
// PostgreSQL or CockroachDB, processors/boltstore embedded), so that the
// executor's exactly-once argument holds whichever store it is given.
//
// An implementation's test calls Run with a function that opens a fresh,
// empty store:
//
//	func TestContract(t *testing.T) {
//		storetest.Run(t, func(t *testing.T) processors.Store { return open(t) })
//	}
package storetest

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"github.com/google/go-cmp/cmp/cmpopts"

	"github.com/toolcall-ledger/ledger/ledger"
	"github.com/toolcall-ledger/ledger/processors"
)

// Leases the suite uses: short ones expire within a poll, long ones never
// during a test.
const (
	shortLease = 50 * time.Millisecond
	longLease  = time.Hour
)

// clockSlack bounds how far the store's clock (a database server's now())
// may be from this process's clock and still pass the lease and timestamp
// checks.
const clockSlack = 5 * time.Second

// pollTimeout bounds every wait for a short lease to expire.
const pollTimeout = 10 * time.Second

// unloggedAge is the olderThan of the Unlogged tests that wait for records
// to come of age: short, so that the wait is.
const unloggedAge = 100 * time.Millisecond

// doneStatuses are the statuses Complete accepts (Status.Done): every one
// must be storable, and each must finish the call.
var doneStatuses = []processors.Status{
	processors.StatusSucceeded, processors.StatusFailed, processors.StatusOutcomeUnknown,
	processors.StatusExpired, processors.StatusDenied, processors.StatusRejected,
}

// contractTest is one subtest of the contract Run holds every store to.
type contractTest struct {
	name string
	fn   func(t *testing.T, s processors.Store)
}

// Run runs the contract suite. Every subtest calls open for a fresh, empty
// store of its own, runs in parallel with the others and closes the store
// when it ends (open must not close it; it may register cleanup of other
// resources with t.Cleanup, which then runs after the store is closed).
func Run(t *testing.T, open func(t *testing.T) processors.Store) {
	t.Helper()
	tests := []contractTest{
		{"Admit/Admitted", testAdmitAdmitted},
		{"Admit/Duplicate", testAdmitDuplicate},
		{"Admit/Conflict", testAdmitConflict},
		{"Admit/OtherUser", testAdmitOtherUser},
		{"Admit/Statuses", testAdmitStatuses},
		{"Admit/InvalidStatus", testAdmitInvalidStatus},
		{"Admit/Unholdable", testAdmitUnholdable},
		{"Admit/IntraBatch", testAdmitIntraBatch},
		{"Admit/BatchOrder", testAdmitBatchOrder},
		{"Claim/Claimed", testClaimClaimed},
		{"Claim/MarksLogged", testClaimMarksLogged},
		{"Claim/Busy", testClaimBusy},
		{"Claim/Finished", testClaimFinished},
		{"Claim/NotReady", testClaimNotReady},
		{"Claim/Missing", testClaimMissing},
		{"Claim/Mismatch", testClaimMismatch},
		{"Claim/Invalid", testClaimInvalid},
		{"Claim/IntraBatch", testClaimIntraBatch},
		{"Claim/BatchOrder", testClaimBatchOrder},
		{"Lease/ExpiredReclaimed", testLeaseExpiredReclaimed},
		{"Expired/OrderAndLimit", testExpiredOrderAndLimit},
		{"Complete/Applied", testCompleteApplied},
		{"Complete/Fenced", testCompleteFenced},
		{"Complete/InvalidStatus", testCompleteInvalidStatus},
		{"Complete/IntraBatch", testCompleteIntraBatch},
		{"Complete/BatchOrder", testCompleteBatchOrder},
		{"Release/Applied", testReleaseApplied},
		{"Release/NotApplied", testReleaseNotApplied},
		{"MarkLogged/Monotonic", testMarkLoggedMonotonic},
		{"MarkLogged/Batch", testMarkLoggedBatch},
		{"Unlogged/OlderThan", testUnloggedOlderThan},
		{"Unlogged/MarkLogged", testUnloggedMarkLogged},
		{"Unlogged/OrderAndLimit", testUnloggedOrderAndLimit},
		{"Unlogged/After", testUnloggedAfter},
		{"Unlogged/Scope", testUnloggedScope},
		{"Unlogged/Moved", testUnloggedMoved},
		{"Move/Applied", testMoveApplied},
		{"Move/NotApplied", testMoveNotApplied},
		{"Move/Invalid", testMoveInvalid},
		{"Move/IntraBatch", testMoveIntraBatch},
		{"Move/BatchOrder", testMoveBatchOrder},
		{"Move/Result", testMoveResult},
		{"ByStatus/OrderAndLimit", testByStatusOrderAndLimit},
		{"ByStatus/Follows", testByStatusFollows},
		{"TenantByStatus", testTenantByStatus},
		{"TenantByStatus/Interleaved", testTenantByStatusInterleaved},
		{"ByStatusAfter", testByStatusAfter},
		{"Get/NotFound", testGetNotFound},
		{"ReadBack", testReadBack},
		{"TenantIsolation", testTenantIsolation},
		{"EmptyBatches", testEmptyBatches},
		{"CancelledContext", testCancelledContext},
		{"Concurrent/AdmitClaim", testConcurrentAdmitClaim},
		{"Concurrent/Complete", testConcurrentComplete},
		{"Concurrent/Move", testConcurrentMove},
	}
	tests = append(tests, journalTests()...)
	tests = append(tests, credentialTests()...)
	tests = append(tests, undoTests()...)
	tests = append(tests, unansweredTests()...)
	tests = append(tests, rateLimitTests()...)
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			s := open(t)
			t.Cleanup(func() {
				if err := s.Close(); err != nil {
					t.Errorf("Close() = %v; want nil", err)
				}
			})
			tc.fn(t, s)
		})
	}
}

// ---------------------------------------------------------------- fixtures

const (
	hashA = "sha256:aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa"
	hashB = "sha256:bbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb"
)

func key(idem string) ledger.CallKey {
	return ledger.CallKey{TenantID: "t_acme", IdempotencyKey: idem}
}

// admission is a complete admission for k: every field set, so that a
// store that drops one fails the record comparisons.
func admission(k ledger.CallKey, hash string, st processors.Status) processors.Admission {
	return processors.Admission{
		Key:           k,
		CallID:        "call_" + k.IdempotencyKey,
		ArgumentsHash: hash,
		UserID:        "u_alice",
		Tool:          "refund_order",
		ToolVersion:   3,
		ToolDigest:    "sha256:5d41402abc4b2a76b9719d911017c592ae7d3e0b4a5b4e9c2f3b3c1a7e4f9d10",
		Arguments:     []byte(`{"amount_cents":4500,"order_id":"ord_1029"}`),
		// Microseconds: the precision of PostgreSQL and CockroachDB.
		DeadlineAt: time.Date(2031, 5, 6, 7, 8, 9, 123456000, time.UTC),
		Status:     st,
		Seq:        2,
		Outbox:     []byte(`[{"seq":1},{"seq":2}]`),
	}
}

// fromAdmission is the record Admit must create for a.
func fromAdmission(a processors.Admission) processors.Record {
	return processors.Record{
		Key:           a.Key,
		CallID:        a.CallID,
		ArgumentsHash: a.ArgumentsHash,
		UserID:        a.UserID,
		Tool:          a.Tool,
		ToolVersion:   a.ToolVersion,
		ToolDigest:    a.ToolDigest,
		Arguments:     a.Arguments,
		DeadlineAt:    a.DeadlineAt,
		Status:        a.Status,
		Seq:           a.Seq,
		Outbox:        a.Outbox,
	}
}

func claim(k ledger.CallKey, hash, owner string, lease time.Duration) processors.Claim {
	return processors.Claim{Key: k, ArgumentsHash: hash, Owner: owner, Lease: lease}
}

// ignoreStoreSet ignores the fields the store fills from its own clock;
// tests check those separately, against bounds.
var ignoreStoreSet = cmpopts.IgnoreFields(processors.Record{}, "CreatedAt", "UpdatedAt", "LeaseUntil")

// equateEmpty: a store may return nil or empty for an empty byte slice.
var equateEmpty = cmpopts.EquateEmpty()

// ---------------------------------------------------------------- helpers

func mustAdmit(t *testing.T, s processors.Store, as ...processors.Admission) []processors.AdmitResult {
	t.Helper()
	got, err := s.Admit(t.Context(), as)
	if err != nil {
		t.Fatalf("Admit(%d admissions) = %v; want nil error", len(as), err)
	}
	if len(got) != len(as) {
		t.Fatalf("Admit(%d admissions) returned %d results; want %d", len(as), len(got), len(as))
	}
	return got
}

func mustClaim(t *testing.T, s processors.Store, cs ...processors.Claim) []processors.ClaimResult {
	t.Helper()
	got, err := s.Claim(t.Context(), cs)
	if err != nil {
		t.Fatalf("Claim(%d claims) = %v; want nil error", len(cs), err)
	}
	if len(got) != len(cs) {
		t.Fatalf("Claim(%d claims) returned %d results; want %d", len(cs), len(got), len(cs))
	}
	return got
}

func mustComplete(t *testing.T, s processors.Store, cs ...processors.Completion) []bool {
	t.Helper()
	got, err := s.Complete(t.Context(), cs)
	if err != nil {
		t.Fatalf("Complete(%d completions) = %v; want nil error", len(cs), err)
	}
	if len(got) != len(cs) {
		t.Fatalf("Complete(%d completions) returned %d results; want %d", len(cs), len(got), len(cs))
	}
	return got
}

func mustRelease(t *testing.T, s processors.Store, rs ...processors.Release) []bool {
	t.Helper()
	got, err := s.Release(t.Context(), rs)
	if err != nil {
		t.Fatalf("Release(%d releases) = %v; want nil error", len(rs), err)
	}
	if len(got) != len(rs) {
		t.Fatalf("Release(%d releases) returned %d results; want %d", len(rs), len(got), len(rs))
	}
	return got
}

func mustMarkLogged(t *testing.T, s processors.Store, ls ...processors.Logged) {
	t.Helper()
	if err := s.MarkLogged(t.Context(), ls); err != nil {
		t.Fatalf("MarkLogged(%d) = %v; want nil", len(ls), err)
	}
}

func mustMove(t *testing.T, s processors.Store, ms ...processors.Move) []bool {
	t.Helper()
	got, err := s.Move(t.Context(), ms)
	if err != nil {
		t.Fatalf("Move(%d moves) = %v; want nil error", len(ms), err)
	}
	if len(got) != len(ms) {
		t.Fatalf("Move(%d moves) returned %d results; want %d", len(ms), len(got), len(ms))
	}
	return got
}

func mustByStatus(t *testing.T, s processors.Store, st processors.Status, limit int) []processors.Record {
	t.Helper()
	rs, err := s.ByStatus(t.Context(), st, limit)
	if err != nil {
		t.Fatalf("ByStatus(%q, %d) = %v; want nil error", st, limit, err)
	}
	return rs
}

func mustGet(t *testing.T, s processors.Store, k ledger.CallKey) processors.Record {
	t.Helper()
	r, err := s.Get(t.Context(), k)
	if err != nil {
		t.Fatalf("Get(%v) = %v; want nil error", k, err)
	}
	return r
}

func mustExpired(t *testing.T, s processors.Store, limit int) []processors.Record {
	t.Helper()
	rs, err := s.Expired(t.Context(), limit)
	if err != nil {
		t.Fatalf("Expired(%d) = %v; want nil error", limit, err)
	}
	return rs
}

// mustUnlogged is mustUnloggedAfter from the oldest.
func mustUnlogged(t *testing.T, s processors.Store, olderThan time.Duration, limit int) []processors.Record {
	t.Helper()
	return mustUnloggedAfter(t, s, olderThan, processors.Cursor{}, limit)
}

func mustUnloggedAfter(t *testing.T, s processors.Store, olderThan time.Duration, after processors.Cursor, limit int) []processors.Record {
	t.Helper()
	rs, err := s.Unlogged(t.Context(), olderThan, after, limit)
	if err != nil {
		t.Fatalf("Unlogged(%v, after %v, %d) = %v; want nil error", olderThan, after, limit, err)
	}
	if rs == nil {
		t.Fatalf("Unlogged(%v, after %v, %d) = nil slice; want a slice, empty if nothing is unlogged", olderThan, after, limit)
	}
	return rs
}

// waitUnlogged waits until Unlogged(unloggedAge, 100) lists exactly the
// keys want, in that order, and returns what it listed.
func waitUnlogged(t *testing.T, s processors.Store, want []ledger.CallKey) []processors.Record {
	t.Helper()
	var got []processors.Record
	waitFor(t, pollTimeout, func() error {
		got = mustUnlogged(t, s, unloggedAge, 100)
		if ks := keysOf(got); !slices.Equal(ks, want) {
			return fmt.Errorf("Unlogged(%v, 100) keys = %v; want %v", unloggedAge, ks, want)
		}
		return nil
	})
	return got
}

// admitClaimed admits k as authorized and claims it under lease; it
// returns the claimed record.
func admitClaimed(t *testing.T, s processors.Store, k ledger.CallKey, owner string, lease time.Duration) processors.Record {
	t.Helper()
	mustAdmit(t, s, admission(k, hashA, processors.StatusAuthorized))
	got := mustClaim(t, s, claim(k, hashA, owner, lease))
	if got[0].Outcome != processors.Claimed {
		t.Fatalf("Claim(%v) outcome = %v; want Claimed", k, got[0].Outcome)
	}
	return got[0].Record
}

// checkUnchanged fails if the record for k differs from before, store-set
// fields included: the operation under test must not have written.
func checkUnchanged(t *testing.T, s processors.Store, k ledger.CallKey, before processors.Record) {
	t.Helper()
	if diff := cmp.Diff(before, mustGet(t, s, k), equateEmpty); diff != "" {
		t.Errorf("Get(%v) changed (-before +after):\n%s", k, diff)
	}
}

// checkWithin fails unless got is within clockSlack of [lo, hi].
func checkWithin(t *testing.T, what string, got, lo, hi time.Time) {
	t.Helper()
	if got.Before(lo.Add(-clockSlack)) || got.After(hi.Add(clockSlack)) {
		t.Errorf("%s = %v; want within [%v, %v] (±%v)", what, got, lo, hi, clockSlack)
	}
}

// waitFor polls cond until it returns nil or timeout passes.
func waitFor(t *testing.T, timeout time.Duration, cond func() error) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	tick := time.NewTicker(10 * time.Millisecond)
	defer tick.Stop()
	for {
		err := cond()
		if err == nil {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("condition not met after %v: %v", timeout, err)
		}
		select {
		case <-t.Context().Done():
			t.Fatalf("context done while waiting: %v", err)
		case <-tick.C:
		}
	}
}

// waitExpired waits until Expired lists k.
func waitExpired(t *testing.T, s processors.Store, k ledger.CallKey) processors.Record {
	t.Helper()
	var found processors.Record
	waitFor(t, pollTimeout, func() error {
		for _, r := range mustExpired(t, s, 100) {
			if r.Key == k {
				found = r
				return nil
			}
		}
		return fmt.Errorf("Expired does not list %v", k)
	})
	return found
}

func keysOf(rs []processors.Record) []ledger.CallKey {
	ks := make([]ledger.CallKey, 0, len(rs))
	for _, r := range rs {
		ks = append(ks, r.Key)
	}
	return ks
}

// ---------------------------------------------------------------- Admit

func testAdmitAdmitted(t *testing.T, s processors.Store) {
	tests := []struct {
		name string
		edit func(a *processors.Admission)
	}{
		{"all fields", func(*processors.Admission) {}},
		{"no deadline", func(a *processors.Admission) { a.DeadlineAt = time.Time{} }},
		{"empty outbox", func(a *processors.Admission) { a.Seq, a.Outbox = 0, nil }},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			a := admission(key("admitted:"+tc.name), hashA, processors.StatusAuthorized)
			tc.edit(&a)
			before := time.Now()
			got := mustAdmit(t, s, a)
			after := time.Now()

			if got[0].Outcome != processors.Admitted {
				t.Errorf("Admit outcome = %v; want Admitted", got[0].Outcome)
			}
			want := fromAdmission(a)
			if diff := cmp.Diff(want, got[0].Record, ignoreStoreSet, equateEmpty); diff != "" {
				t.Errorf("Admit record mismatch (-want +got):\n%s", diff)
			}
			r := got[0].Record
			checkWithin(t, "CreatedAt", r.CreatedAt, before, after)
			checkWithin(t, "UpdatedAt", r.UpdatedAt, before, after)
			if !r.LeaseUntil.IsZero() {
				t.Errorf("LeaseUntil = %v; want zero", r.LeaseUntil)
			}
			if gotU, wantU := r.Unlogged(), len(a.Outbox) > 0; gotU != wantU {
				t.Errorf("Unlogged() = %v; want %v", gotU, wantU)
			}
			if diff := cmp.Diff(r, mustGet(t, s, a.Key), equateEmpty); diff != "" {
				t.Errorf("Get after Admit differs from Admit's record (-admit +get):\n%s", diff)
			}
		})
	}
}

func testAdmitDuplicate(t *testing.T, s processors.Store) {
	k := key("dup")
	first := mustAdmit(t, s, admission(k, hashA, processors.StatusAuthorized))[0].Record

	// A retry of the same call: same hash, other details differ (a new
	// call_id, another step's outbox); the original record stands.
	retry := admission(k, hashA, processors.StatusDenied)
	retry.CallID = "call_retry"
	retry.Seq, retry.Outbox = 7, []byte(`[{"seq":7}]`)
	got := mustAdmit(t, s, retry)

	if got[0].Outcome != processors.Duplicate {
		t.Errorf("Admit(retry) outcome = %v; want Duplicate", got[0].Outcome)
	}
	if diff := cmp.Diff(first, got[0].Record, equateEmpty); diff != "" {
		t.Errorf("Admit(retry) record is not the original (-original +got):\n%s", diff)
	}
	checkUnchanged(t, s, k, first)
}

func testAdmitConflict(t *testing.T, s processors.Store) {
	k := key("conflict")
	first := mustAdmit(t, s, admission(k, hashA, processors.StatusAuthorized))[0].Record

	got := mustAdmit(t, s, admission(k, hashB, processors.StatusAuthorized))
	if got[0].Outcome != processors.Conflict {
		t.Errorf("Admit(other hash) outcome = %v; want Conflict", got[0].Outcome)
	}
	if diff := cmp.Diff(first, got[0].Record, equateEmpty); diff != "" {
		t.Errorf("Admit(other hash) record is not the original (-original +got):\n%s", diff)
	}
	checkUnchanged(t, s, k, first)
}

// Another user's admission under a key is a Conflict, even with the same
// arguments, alone or in the batch that admits the key; the record keeps
// its user. An admission without a user (a call the ledger makes itself)
// is compared by its hash alone.
func testAdmitOtherUser(t *testing.T, s processors.Store) {
	k := key("other-user")
	first := mustAdmit(t, s, admission(k, hashA, processors.StatusAuthorized))[0].Record
	if first.UserID != "u_alice" {
		t.Errorf("admitted record's user = %q; want u_alice", first.UserID)
	}
	bob := admission(k, hashA, processors.StatusAuthorized)
	bob.UserID = "u_bob"
	noUser := bob
	noUser.UserID = ""
	for _, tc := range []struct {
		a    processors.Admission
		want processors.AdmitOutcome
	}{{bob, processors.Conflict}, {noUser, processors.Duplicate}} {
		got := mustAdmit(t, s, tc.a)
		if got[0].Outcome != tc.want {
			t.Errorf("Admit(same hash, user %q) outcome = %v; want %v", tc.a.UserID, got[0].Outcome, tc.want)
		}
		if diff := cmp.Diff(first, got[0].Record, equateEmpty); diff != "" {
			t.Errorf("Admit(same hash, user %q) record is not the original (-original +got):\n%s", tc.a.UserID, diff)
		}
	}
	checkUnchanged(t, s, k, first)

	k2 := key("other-user-batch")
	a2, b2 := admission(k2, hashA, processors.StatusAuthorized), admission(k2, hashA, processors.StatusAuthorized)
	b2.UserID = "u_bob"
	got := mustAdmit(t, s, a2, b2, a2)
	want := []processors.AdmitOutcome{processors.Admitted, processors.Conflict, processors.Duplicate}
	for i := range want {
		if got[i].Outcome != want[i] {
			t.Errorf("Admit(alice, bob, alice under one key)[%d] = %v; want %v", i, got[i].Outcome, want[i])
		}
		if got[i].Record.UserID != "u_alice" {
			t.Errorf("Admit(alice, bob, alice under one key)[%d] record's user = %q; want u_alice", i, got[i].Record.UserID)
		}
	}
}

func testAdmitStatuses(t *testing.T, s processors.Store) {
	for _, st := range []processors.Status{processors.StatusAuthorized, processors.StatusDenied, processors.StatusPending} {
		t.Run(string(st), func(t *testing.T) {
			k := key("status:" + string(st))
			got := mustAdmit(t, s, admission(k, hashA, st))
			if got[0].Outcome != processors.Admitted || got[0].Record.Status != st {
				t.Errorf("Admit(%s) = %v, status %q; want Admitted, %q", st, got[0].Outcome, got[0].Record.Status, st)
			}
			if r := mustGet(t, s, k); r.Status != st || r.Epoch != 0 || r.Attempt != 0 || r.LoggedSeq != 0 {
				t.Errorf("Get = status %q epoch %d attempt %d logged %d; want %q 0 0 0", r.Status, r.Epoch, r.Attempt, r.LoggedSeq, st)
			}
		})
	}
}

func testAdmitInvalidStatus(t *testing.T, s processors.Store) {
	for _, st := range []processors.Status{"", processors.StatusExecuting, processors.StatusSucceeded, "bogus"} {
		t.Run(string(st), func(t *testing.T) {
			ok := admission(key("valid:"+string(st)), hashA, processors.StatusAuthorized)
			bad := admission(key("invalid:"+string(st)), hashA, st)
			if _, err := s.Admit(t.Context(), []processors.Admission{ok, bad}); !errors.Is(err, processors.ErrRejected) {
				t.Errorf("Admit(status %q) = %v; want an error wrapping ErrRejected (the data is the problem)", st, err)
			}
			// The batch is one transaction: nothing of it is stored.
			for _, k := range []ledger.CallKey{ok.Key, bad.Key} {
				if _, err := s.Get(t.Context(), k); !errors.Is(err, processors.ErrNotFound) {
					t.Errorf("Get(%v) after failed Admit = %v; want ErrNotFound", k, err)
				}
			}
		})
	}
}

// testAdmitUnholdable: data a store cannot hold as given (PostgreSQL's
// TEXT refuses NUL and invalid UTF-8; JSON would replace invalid UTF-8)
// is either stored intact or refused with ErrRejected, so that the intake
// can set the one call aside instead of retrying its batch forever. It is
// never stored altered.
func testAdmitUnholdable(t *testing.T, s processors.Store) {
	tests := []struct {
		name string
		edit func(a *processors.Admission)
	}{
		{"NUL in call_id", func(a *processors.Admission) { a.CallID = "call\x00x" }},
		{"invalid UTF-8 in call_id", func(a *processors.Admission) { a.CallID = "call\xffx" }},
		{"NUL in tool", func(a *processors.Admission) { a.Tool = "refund\x00order" }},
		{"invalid UTF-8 in idempotency_key", func(a *processors.Admission) { a.Key.IdempotencyKey += "\xc3" }},
		{"invalid UTF-8 in tenant_id", func(a *processors.Admission) { a.Key.TenantID += "\xff" }},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			ok := admission(key("holdable:"+tc.name), hashA, processors.StatusAuthorized)
			bad := admission(key("unholdable:"+tc.name), hashA, processors.StatusAuthorized)
			tc.edit(&bad)
			got, err := s.Admit(t.Context(), []processors.Admission{ok, bad})
			switch {
			case errors.Is(err, processors.ErrRejected):
				// The batch is one transaction: nothing of it is stored.
				if _, err := s.Get(t.Context(), ok.Key); !errors.Is(err, processors.ErrNotFound) {
					t.Errorf("Get(%v) after a rejected Admit = %v; want ErrNotFound", ok.Key, err)
				}
			case err != nil:
				t.Fatalf("Admit(%s) = %v; want nil or an error wrapping ErrRejected", tc.name, err)
			default:
				if got[1].Outcome != processors.Admitted {
					t.Errorf("Admit(%s) outcome = %v; want Admitted", tc.name, got[1].Outcome)
				}
				if diff := cmp.Diff(fromAdmission(bad), mustGet(t, s, bad.Key), ignoreStoreSet, equateEmpty); diff != "" {
					t.Errorf("Admit(%s) stored the record altered (-admitted +got):\n%s", tc.name, diff)
				}
			}
		})
	}
	// What a claim stores: its owner and its credential.
	for _, tc := range []struct {
		name string
		edit func(c *processors.Claim)
	}{
		{"owner", func(c *processors.Claim) { c.Owner = "executor-\xff" }},
		{"jti", func(c *processors.Claim) { c.Credential.JTI = "jti-\xc3" }},
		{"credential family", func(c *processors.Claim) { c.Credential.Family = "refund_order/\xff" }},
	} {
		t.Run("invalid UTF-8 in "+tc.name, func(t *testing.T) {
			k := key("unholdable:" + tc.name)
			before := mustAdmit(t, s, admission(k, hashA, processors.StatusAuthorized))[0].Record
			c := claim(k, hashA, "executor-1", longLease)
			c.Credential = processors.CallCredential{JTI: "jti-1", Family: "refund_order/t_acme/1"}
			tc.edit(&c)
			_, err := s.Claim(t.Context(), []processors.Claim{c})
			switch {
			case errors.Is(err, processors.ErrRejected):
				checkUnchanged(t, s, k, before)
			case err != nil:
				t.Fatalf("Claim(invalid UTF-8 in %s) = %v; want nil or an error wrapping ErrRejected", tc.name, err)
			default:
				if r := mustGet(t, s, k); r.LeaseOwner != c.Owner || r.Credential != c.Credential {
					t.Errorf("Claim(owner %q, credential %q) stored owner %q, credential %q; want them intact", c.Owner, c.Credential, r.LeaseOwner, r.Credential)
				}
			}
		})
	}
}

func testAdmitIntraBatch(t *testing.T, s processors.Store) {
	k := key("intra")
	first := admission(k, hashA, processors.StatusAuthorized)
	again := admission(k, hashA, processors.StatusDenied)
	again.CallID = "call_again"
	other := admission(k, hashB, processors.StatusAuthorized)

	got := mustAdmit(t, s, first, again, other)
	wantOutcomes := []processors.AdmitOutcome{processors.Admitted, processors.Duplicate, processors.Conflict}
	for i, w := range wantOutcomes {
		if got[i].Outcome != w {
			t.Errorf("Admit batch[%d] outcome = %v; want %v", i, got[i].Outcome, w)
		}
		if diff := cmp.Diff(fromAdmission(first), got[i].Record, ignoreStoreSet, equateEmpty); diff != "" {
			t.Errorf("Admit batch[%d] record is not the first admission's (-want +got):\n%s", i, diff)
		}
	}
	checkUnchanged(t, s, k, got[0].Record)
}

func testAdmitBatchOrder(t *testing.T, s processors.Store) {
	pre := admission(key("order:existing"), hashA, processors.StatusAuthorized)
	mustAdmit(t, s, pre)

	batch := []processors.Admission{
		admission(key("order:z"), hashA, processors.StatusAuthorized),
		admission(key("order:existing"), hashA, processors.StatusAuthorized),
		admission(key("order:a"), hashB, processors.StatusPending),
		admission(key("order:existing"), hashB, processors.StatusAuthorized),
		admission(key("order:m"), hashA, processors.StatusDenied),
	}
	want := []processors.AdmitOutcome{processors.Admitted, processors.Duplicate, processors.Admitted, processors.Conflict, processors.Admitted}
	got := mustAdmit(t, s, batch...)
	for i := range batch {
		if got[i].Outcome != want[i] || got[i].Record.Key != batch[i].Key {
			t.Errorf("Admit batch[%d] = %v for %v; want %v for %v", i, got[i].Outcome, got[i].Record.Key, want[i], batch[i].Key)
		}
	}
	if got[2].Record.Status != processors.StatusPending || got[2].Record.ArgumentsHash != hashB {
		t.Errorf("Admit batch[2] record = %q %q; want %q %q", got[2].Record.Status, got[2].Record.ArgumentsHash, processors.StatusPending, hashB)
	}
}

// ---------------------------------------------------------------- Claim

func testClaimClaimed(t *testing.T, s processors.Store) {
	k := key("claimed")
	admitted := mustAdmit(t, s, admission(k, hashA, processors.StatusAuthorized))[0].Record

	before := time.Now()
	got := mustClaim(t, s, claim(k, hashA, "executor-1", longLease))
	after := time.Now()

	if got[0].Outcome != processors.Claimed {
		t.Fatalf("Claim outcome = %v; want Claimed", got[0].Outcome)
	}
	want := admitted
	want.Status = processors.StatusExecuting
	want.Epoch = 1
	want.LeaseOwner = "executor-1"
	// Attempt counts tool invocations; Complete sets it, Claim does not.
	want.Attempt = 0
	r := got[0].Record
	if diff := cmp.Diff(want, r, ignoreStoreSet, equateEmpty); diff != "" {
		t.Errorf("Claim record mismatch (-want +got):\n%s", diff)
	}
	checkWithin(t, "LeaseUntil", r.LeaseUntil, before.Add(longLease), after.Add(longLease))
	if !r.CreatedAt.Equal(admitted.CreatedAt) {
		t.Errorf("CreatedAt = %v; want unchanged %v", r.CreatedAt, admitted.CreatedAt)
	}
	if diff := cmp.Diff(r, mustGet(t, s, k), equateEmpty); diff != "" {
		t.Errorf("Get after Claim differs from Claim's record (-claim +get):\n%s", diff)
	}
}

// testClaimMarksLogged: a claim made from an event read from the log
// records the record logged up to that event's seq, never past the
// record's seq and never lower than it was; a claim that does not win
// writes nothing.
func testClaimMarksLogged(t *testing.T, s processors.Store) {
	for _, tc := range []struct {
		name          string
		marked, claim int64 // LoggedSeq before the claim; the claim's Logged
		want          int64
	}{
		{"from the log", 0, 2, 2},
		{"from a sweep", 0, 0, 0},
		{"never past the record", 0, 9, 2},
		{"never lowered", 2, 1, 2},
		{"part of the record", 0, 1, 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			k := key("marks-logged:" + tc.name)
			mustAdmit(t, s, admission(k, hashA, processors.StatusAuthorized))
			if tc.marked > 0 {
				mustMarkLogged(t, s, processors.Logged{Key: k, Seq: tc.marked})
			}
			c := claim(k, hashA, "executor-1", longLease)
			c.Logged = tc.claim
			got := mustClaim(t, s, c)
			if got[0].Outcome != processors.Claimed {
				t.Fatalf("Claim outcome = %v; want Claimed", got[0].Outcome)
			}
			if got[0].Record.LoggedSeq != tc.want {
				t.Errorf("Claim with Logged %d of a record logged to %d: LoggedSeq = %d; want %d", tc.claim, tc.marked, got[0].Record.LoggedSeq, tc.want)
			}
			if r := mustGet(t, s, k); r.LoggedSeq != tc.want {
				t.Errorf("Get after the claim: LoggedSeq = %d; want %d", r.LoggedSeq, tc.want)
			}
		})
	}
	t.Run("reclaimed", func(t *testing.T) {
		k := key("marks-logged:reclaimed")
		admitClaimed(t, s, k, "executor-1", shortLease)
		waitExpired(t, s, k)
		c := claim(k, hashA, "executor-2", longLease)
		c.Logged = 2
		got := mustClaim(t, s, c)
		if got[0].Outcome != processors.Reclaimed {
			t.Fatalf("Claim of an expired lease outcome = %v; want Reclaimed", got[0].Outcome)
		}
		if got[0].Record.LoggedSeq != 2 {
			t.Errorf("Reclaim with Logged 2: LoggedSeq = %d; want 2", got[0].Record.LoggedSeq)
		}
	})
	t.Run("busy", func(t *testing.T) {
		k := key("marks-logged:busy")
		held := admitClaimed(t, s, k, "executor-1", longLease)
		c := claim(k, hashA, "executor-2", longLease)
		c.Logged = 2
		if got := mustClaim(t, s, c); got[0].Outcome != processors.Busy {
			t.Fatalf("Claim of a live lease outcome = %v; want Busy", got[0].Outcome)
		}
		checkUnchanged(t, s, k, held)
	})
}

func testClaimBusy(t *testing.T, s processors.Store) {
	k := key("busy")
	held := admitClaimed(t, s, k, "executor-1", longLease)

	for _, owner := range []string{"executor-2", "executor-1"} {
		got := mustClaim(t, s, claim(k, hashA, owner, longLease))
		if got[0].Outcome != processors.Busy {
			t.Errorf("Claim by %s of a live lease outcome = %v; want Busy", owner, got[0].Outcome)
		}
		if diff := cmp.Diff(held, got[0].Record, equateEmpty); diff != "" {
			t.Errorf("Busy record is not the holder's (-held +got):\n%s", diff)
		}
	}
	checkUnchanged(t, s, k, held)
}

func testClaimFinished(t *testing.T, s processors.Store) {
	t.Run(string(processors.StatusDenied), func(t *testing.T) {
		k := key("finished:denied")
		r := mustAdmit(t, s, admission(k, hashA, processors.StatusDenied))[0].Record
		got := mustClaim(t, s, claim(k, hashA, "executor-1", longLease))
		if got[0].Outcome != processors.Finished {
			t.Errorf("Claim(denied) outcome = %v; want Finished", got[0].Outcome)
		}
		if diff := cmp.Diff(r, got[0].Record, equateEmpty); diff != "" {
			t.Errorf("Finished record mismatch (-want +got):\n%s", diff)
		}
		checkUnchanged(t, s, k, r)
	})
	for _, st := range doneStatuses {
		t.Run("completed "+string(st), func(t *testing.T) {
			k := key("finished:completed:" + string(st))
			c := admitClaimed(t, s, k, "executor-1", longLease)
			mustComplete(t, s, processors.Completion{Key: k, Epoch: c.Epoch, Status: st, Attempt: 1, Seq: 4, Outbox: []byte("x")})
			done := mustGet(t, s, k)
			got := mustClaim(t, s, claim(k, hashA, "executor-2", longLease))
			if got[0].Outcome != processors.Finished {
				t.Errorf("Claim(%s) outcome = %v; want Finished", st, got[0].Outcome)
			}
			if diff := cmp.Diff(done, got[0].Record, equateEmpty); diff != "" {
				t.Errorf("Finished record mismatch (-want +got):\n%s", diff)
			}
			checkUnchanged(t, s, k, done)
		})
	}
}

func testClaimNotReady(t *testing.T, s processors.Store) {
	k := key("pending")
	r := mustAdmit(t, s, admission(k, hashA, processors.StatusPending))[0].Record
	got := mustClaim(t, s, claim(k, hashA, "executor-1", longLease))
	if got[0].Outcome != processors.NotReady {
		t.Errorf("Claim(pending) outcome = %v; want NotReady", got[0].Outcome)
	}
	if diff := cmp.Diff(r, got[0].Record, equateEmpty); diff != "" {
		t.Errorf("NotReady record mismatch (-want +got):\n%s", diff)
	}
	checkUnchanged(t, s, k, r)
}

func testClaimMissing(t *testing.T, s processors.Store) {
	got := mustClaim(t, s, claim(key("missing"), hashA, "executor-1", longLease))
	if got[0].Outcome != processors.Missing {
		t.Errorf("Claim(missing) outcome = %v; want Missing", got[0].Outcome)
	}
	if _, err := s.Get(t.Context(), key("missing")); !errors.Is(err, processors.ErrNotFound) {
		t.Errorf("Get after Claim(missing) = %v; want ErrNotFound (Claim must not create)", err)
	}
}

// testClaimMismatch: the hash is checked first, whatever state the record
// is in, so a reused key never runs, reclaims or learns anything else.
func testClaimMismatch(t *testing.T, s processors.Store) {
	tests := []struct {
		name  string
		setup func(t *testing.T, k ledger.CallKey)
	}{
		{"authorized", func(t *testing.T, k ledger.CallKey) {
			mustAdmit(t, s, admission(k, hashA, processors.StatusAuthorized))
		}},
		{"pending", func(t *testing.T, k ledger.CallKey) {
			mustAdmit(t, s, admission(k, hashA, processors.StatusPending))
		}},
		{"denied", func(t *testing.T, k ledger.CallKey) {
			mustAdmit(t, s, admission(k, hashA, processors.StatusDenied))
		}},
		{"live lease", func(t *testing.T, k ledger.CallKey) {
			admitClaimed(t, s, k, "executor-1", longLease)
		}},
		{"expired lease", func(t *testing.T, k ledger.CallKey) {
			admitClaimed(t, s, k, "executor-1", shortLease)
			waitExpired(t, s, k)
		}},
		{"succeeded", func(t *testing.T, k ledger.CallKey) {
			c := admitClaimed(t, s, k, "executor-1", longLease)
			mustComplete(t, s, processors.Completion{Key: k, Epoch: c.Epoch, Status: processors.StatusSucceeded, Attempt: 1, Seq: 4})
		}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			k := key("mismatch:" + tc.name)
			tc.setup(t, k)
			before := mustGet(t, s, k)
			got := mustClaim(t, s, claim(k, hashB, "executor-2", longLease))
			if got[0].Outcome != processors.Mismatch {
				t.Errorf("Claim(other hash) of %s outcome = %v; want Mismatch", tc.name, got[0].Outcome)
			}
			if diff := cmp.Diff(before, got[0].Record, equateEmpty); diff != "" {
				t.Errorf("Mismatch record mismatch (-want +got):\n%s", diff)
			}
			checkUnchanged(t, s, k, before)
		})
	}
}

func testClaimInvalid(t *testing.T, s processors.Store) {
	k := key("invalid-claim")
	r := mustAdmit(t, s, admission(k, hashA, processors.StatusAuthorized))[0].Record
	tests := []struct {
		name string
		c    processors.Claim
	}{
		{"zero lease", claim(k, hashA, "executor-1", 0)},
		{"negative lease", claim(k, hashA, "executor-1", -time.Second)},
		{"no owner", claim(k, hashA, "", longLease)},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			if _, err := s.Claim(t.Context(), []processors.Claim{tc.c}); !errors.Is(err, processors.ErrRejected) {
				t.Errorf("Claim(%s) = %v; want an error wrapping ErrRejected", tc.name, err)
			}
			checkUnchanged(t, s, k, r)
		})
	}
}

func testClaimIntraBatch(t *testing.T, s processors.Store) {
	t.Run("second sees the first's lease", func(t *testing.T) {
		k := key("intra-claim:busy")
		mustAdmit(t, s, admission(k, hashA, processors.StatusAuthorized))
		got := mustClaim(t, s, claim(k, hashA, "executor-1", longLease), claim(k, hashA, "executor-2", longLease))
		if got[0].Outcome != processors.Claimed || got[1].Outcome != processors.Busy {
			t.Fatalf("Claim batch outcomes = %v, %v; want Claimed, Busy", got[0].Outcome, got[1].Outcome)
		}
		if diff := cmp.Diff(got[0].Record, got[1].Record, equateEmpty); diff != "" {
			t.Errorf("Busy record is not the first claim's (-first +second):\n%s", diff)
		}
		if r := mustGet(t, s, k); r.LeaseOwner != "executor-1" || r.Epoch != 1 {
			t.Errorf("Get = owner %q epoch %d; want executor-1 1", r.LeaseOwner, r.Epoch)
		}
	})
	t.Run("mismatch first", func(t *testing.T) {
		k := key("intra-claim:mismatch")
		mustAdmit(t, s, admission(k, hashA, processors.StatusAuthorized))
		got := mustClaim(t, s, claim(k, hashB, "executor-1", longLease), claim(k, hashA, "executor-2", longLease))
		if got[0].Outcome != processors.Mismatch || got[1].Outcome != processors.Claimed {
			t.Fatalf("Claim batch outcomes = %v, %v; want Mismatch, Claimed", got[0].Outcome, got[1].Outcome)
		}
		if got[1].Record.LeaseOwner != "executor-2" || got[1].Record.Epoch != 1 {
			t.Errorf("Claimed record owner %q epoch %d; want executor-2 1", got[1].Record.LeaseOwner, got[1].Record.Epoch)
		}
	})
	t.Run("expired lease reclaimed once", func(t *testing.T) {
		k := key("intra-claim:expired")
		admitClaimed(t, s, k, "executor-1", shortLease)
		waitExpired(t, s, k)
		got := mustClaim(t, s, claim(k, hashA, "executor-2", longLease), claim(k, hashA, "executor-3", longLease))
		if got[0].Outcome != processors.Reclaimed || got[1].Outcome != processors.Busy {
			t.Fatalf("Claim batch outcomes = %v, %v; want Reclaimed, Busy", got[0].Outcome, got[1].Outcome)
		}
		if r := mustGet(t, s, k); r.LeaseOwner != "executor-2" || r.Epoch != 2 {
			t.Errorf("Get = owner %q epoch %d; want executor-2 2", r.LeaseOwner, r.Epoch)
		}
	})
}

func testClaimBatchOrder(t *testing.T, s processors.Store) {
	mustAdmit(t, s,
		admission(key("c:auth"), hashA, processors.StatusAuthorized),
		admission(key("c:pending"), hashA, processors.StatusPending),
		admission(key("c:denied"), hashA, processors.StatusDenied),
		admission(key("c:held"), hashA, processors.StatusAuthorized),
		admission(key("c:other"), hashA, processors.StatusAuthorized),
	)
	mustClaim(t, s, claim(key("c:held"), hashA, "executor-0", longLease))

	batch := []processors.Claim{
		claim(key("c:pending"), hashA, "executor-1", longLease),
		claim(key("c:missing"), hashA, "executor-1", longLease),
		claim(key("c:held"), hashA, "executor-1", longLease),
		claim(key("c:auth"), hashA, "executor-1", longLease),
		claim(key("c:other"), hashB, "executor-1", longLease),
		claim(key("c:denied"), hashA, "executor-1", longLease),
	}
	want := []processors.ClaimOutcome{processors.NotReady, processors.Missing, processors.Busy, processors.Claimed, processors.Mismatch, processors.Finished}
	got := mustClaim(t, s, batch...)
	for i := range batch {
		if got[i].Outcome != want[i] {
			t.Errorf("Claim batch[%d] (%v) outcome = %v; want %v", i, batch[i].Key, got[i].Outcome, want[i])
		}
		if want[i] != processors.Missing && got[i].Record.Key != batch[i].Key {
			t.Errorf("Claim batch[%d] record key = %v; want %v", i, got[i].Record.Key, batch[i].Key)
		}
	}
	if r := got[3].Record; r.LeaseOwner != "executor-1" || r.Epoch != 1 || r.Status != processors.StatusExecuting {
		t.Errorf("Claimed record = owner %q epoch %d status %q; want executor-1 1 executing", r.LeaseOwner, r.Epoch, r.Status)
	}
	if r := mustGet(t, s, key("c:other")); r.Status != processors.StatusAuthorized || r.Epoch != 0 {
		t.Errorf("mismatched record = status %q epoch %d; want authorized 0 (untouched)", r.Status, r.Epoch)
	}
}

// ---------------------------------------------------------------- leases

func testLeaseExpiredReclaimed(t *testing.T, s processors.Store) {
	k := key("lease")
	first := admitClaimed(t, s, k, "executor-1", shortLease)

	exp := waitExpired(t, s, k)
	if diff := cmp.Diff(first, exp, equateEmpty); diff != "" {
		t.Errorf("Expired record mismatch (-claimed +expired):\n%s", diff)
	}

	before := time.Now()
	got := mustClaim(t, s, claim(k, hashA, "executor-2", longLease))
	after := time.Now()
	if got[0].Outcome != processors.Reclaimed {
		t.Fatalf("Claim after lease expiry outcome = %v; want Reclaimed", got[0].Outcome)
	}
	want := first
	want.Epoch = 2
	want.LeaseOwner = "executor-2"
	r := got[0].Record
	if diff := cmp.Diff(want, r, ignoreStoreSet, equateEmpty); diff != "" {
		t.Errorf("Reclaimed record mismatch (-want +got):\n%s", diff)
	}
	checkWithin(t, "LeaseUntil", r.LeaseUntil, before.Add(longLease), after.Add(longLease))

	for _, e := range mustExpired(t, s, 100) {
		if e.Key == k {
			t.Errorf("Expired lists %v after it was reclaimed under a live lease", k)
		}
	}

	// Fencing: the first owner woke up; its epoch is stale.
	stale := processors.Completion{Key: k, Epoch: first.Epoch, Status: processors.StatusSucceeded, Attempt: 1, Result: []byte("stale"), Seq: 4, Outbox: []byte("stale")}
	if applied := mustComplete(t, s, stale); applied[0] {
		t.Errorf("Complete(stale epoch %d) applied = true; want false", first.Epoch)
	}
	checkUnchanged(t, s, k, r)

	fresh := processors.Completion{Key: k, Epoch: r.Epoch, Status: processors.StatusOutcomeUnknown, Attempt: 1, Result: []byte("unknown"), Seq: 4, Outbox: []byte("fresh")}
	if applied := mustComplete(t, s, fresh); !applied[0] {
		t.Errorf("Complete(current epoch %d) applied = false; want true", r.Epoch)
	}
	if done := mustGet(t, s, k); done.Status != processors.StatusOutcomeUnknown || string(done.Result) != "unknown" {
		t.Errorf("Get = status %q result %q; want outcome_unknown \"unknown\"", done.Status, done.Result)
	}
}

func testExpiredOrderAndLimit(t *testing.T, s processors.Store) {
	ka, kb, kc, kd := key("exp:a"), key("exp:b"), key("exp:c"), key("exp:d")
	live, waiting := key("exp:live"), key("exp:authorized")
	mustAdmit(t, s,
		admission(ka, hashA, processors.StatusAuthorized),
		admission(kb, hashA, processors.StatusAuthorized),
		admission(kc, hashA, processors.StatusAuthorized),
		admission(kd, hashA, processors.StatusAuthorized),
		admission(live, hashA, processors.StatusAuthorized),
		admission(waiting, hashA, processors.StatusAuthorized),
	)
	// One batch, one store clock reading: the leases end in the order of
	// their lengths, c and d (a tie, in the keys' order) then a then b,
	// whatever the keys' order.
	got := mustClaim(t, s,
		claim(ka, hashA, "executor-1", 2*shortLease),
		claim(kd, hashA, "executor-1", shortLease),
		claim(kb, hashA, "executor-1", 3*shortLease),
		claim(kc, hashA, "executor-1", shortLease),
		claim(live, hashA, "executor-1", longLease),
	)
	for i, g := range got {
		if g.Outcome != processors.Claimed {
			t.Fatalf("Claim batch[%d] outcome = %v; want Claimed", i, g.Outcome)
		}
	}

	want := []ledger.CallKey{kc, kd, ka, kb}
	var all []processors.Record
	waitFor(t, pollTimeout, func() error {
		all = mustExpired(t, s, 100)
		if got := keysOf(all); !slices.Equal(got, want) {
			return fmt.Errorf("Expired(100) keys = %v; want %v", got, want)
		}
		return nil
	})
	if got := keysOf(mustExpired(t, s, 2)); !slices.Equal(got, want[:2]) {
		t.Errorf("Expired(2) keys = %v; want %v", got, want[:2])
	}
	if got := mustExpired(t, s, 0); len(got) != 0 {
		t.Errorf("Expired(0) = %d records; want none", len(got))
	}

	// ExpiredAfter goes on past a cursor in the same order, the tie
	// included: pages of one walk the whole list once.
	expiredAfter := func(after processors.Cursor, limit int) []processors.Record {
		t.Helper()
		rs, err := s.ExpiredAfter(t.Context(), after, limit)
		if err != nil {
			t.Fatalf("ExpiredAfter(%v, %d) = %v; want nil error", after, limit, err)
		}
		return rs
	}
	if got := keysOf(expiredAfter(processors.Cursor{}, 100)); !slices.Equal(got, want) {
		t.Errorf("ExpiredAfter(zero cursor) keys = %v; want %v", got, want)
	}
	var walked []ledger.CallKey
	for after := (processors.Cursor{}); len(walked) <= len(want); {
		page := expiredAfter(after, 1)
		if len(page) == 0 {
			break
		}
		walked = append(walked, page[0].Key)
		after = page[0].LeaseCursor()
	}
	if !slices.Equal(walked, want) {
		t.Errorf("ExpiredAfter in pages of one: %v; want %v", walked, want)
	}
	if got := keysOf(expiredAfter(all[1].LeaseCursor(), 100)); !slices.Equal(got, want[2:]) {
		t.Errorf("ExpiredAfter(cursor of %v) keys = %v; want %v", want[1], got, want[2:])
	}
	if got := expiredAfter(all[len(all)-1].LeaseCursor(), 100); len(got) != 0 {
		t.Errorf("ExpiredAfter(cursor of the last) = %v; want none", keysOf(got))
	}
	// A cursor stays a place in the order when its record leaves it
	// (taken over under a live lease).
	if res := mustClaim(t, s, claim(kd, hashA, "executor-2", longLease)); res[0].Outcome != processors.Reclaimed {
		t.Fatalf("take over %v: %v; want Reclaimed", kd, res[0].Outcome)
	}
	if got := keysOf(expiredAfter(all[1].LeaseCursor(), 100)); !slices.Equal(got, want[2:]) {
		t.Errorf("ExpiredAfter(cursor of %v, taken over since) keys = %v; want %v", want[1], got, want[2:])
	}
}

// ---------------------------------------------------------------- Release

// testReleaseApplied: a released claim stays executing, without an owner,
// as it was otherwise, and no claim takes it until its release ends;
// the sweep then lists it, and the claim that takes it is Claimed, not
// Reclaimed: its owner sent nothing.
func testReleaseApplied(t *testing.T, s processors.Store) {
	held, soon := key("release:held"), key("release:soon")
	heldRec := admitClaimed(t, s, held, "executor-1", longLease)
	soonRec := admitClaimed(t, s, soon, "executor-1", longLease)
	before := time.Now()
	applied := mustRelease(t, s,
		processors.Release{Key: held, Epoch: heldRec.Epoch, After: longLease},
		processors.Release{Key: soon, Epoch: soonRec.Epoch, After: shortLease})
	after := time.Now()
	if !applied[0] || !applied[1] {
		t.Fatalf("Release of current claims applied = %v; want both", applied)
	}
	r := mustGet(t, s, held)
	want := heldRec
	want.LeaseOwner = ""
	if diff := cmp.Diff(want, r, ignoreStoreSet, equateEmpty); diff != "" {
		t.Errorf("released record mismatch (-want +got):\n%s", diff)
	}
	checkWithin(t, "LeaseUntil", r.LeaseUntil, before.Add(longLease), after.Add(longLease))
	if got := mustClaim(t, s, claim(held, hashA, "executor-2", longLease)); got[0].Outcome != processors.Busy {
		t.Errorf("Claim during the release outcome = %v; want Busy", got[0].Outcome)
	}

	waitExpired(t, s, soon)
	got := mustClaim(t, s, claim(soon, hashA, "executor-2", longLease))
	if got[0].Outcome != processors.Claimed {
		t.Fatalf("Claim after the release ended outcome = %v; want Claimed (nothing was sent)", got[0].Outcome)
	}
	if c := got[0].Record; c.Epoch != soonRec.Epoch+1 || c.LeaseOwner != "executor-2" || c.Status != processors.StatusExecuting {
		t.Errorf("claimed record epoch %d owner %q status %q; want %d, executor-2, executing", c.Epoch, c.LeaseOwner, c.Status, soonRec.Epoch+1)
	}
	// A key released twice at one epoch in a batch: the first applies,
	// as in one statement's DISTINCT ON; the record stays executing, so
	// the fence alone would let the second through.
	twice := key("release:twice")
	twiceRec := admitClaimed(t, s, twice, "executor-1", longLease)
	before = time.Now()
	applied = mustRelease(t, s,
		processors.Release{Key: twice, Epoch: twiceRec.Epoch, After: longLease},
		processors.Release{Key: twice, Epoch: twiceRec.Epoch, After: shortLease})
	after = time.Now()
	if !applied[0] || applied[1] {
		t.Errorf("Release of one claim twice in a batch applied = %v; want the first only", applied)
	}
	checkWithin(t, "LeaseUntil after two releases", mustGet(t, s, twice).LeaseUntil, before.Add(longLease), after.Add(longLease))
	// An owner's lease that ran out is still a reclaim.
	lapsed := key("release:lapsed")
	admitClaimed(t, s, lapsed, "executor-1", shortLease)
	waitExpired(t, s, lapsed)
	if got := mustClaim(t, s, claim(lapsed, hashA, "executor-2", longLease)); got[0].Outcome != processors.Reclaimed {
		t.Errorf("Claim of a lapsed, unreleased lease outcome = %v; want Reclaimed", got[0].Outcome)
	}
}

// testReleaseNotApplied: a release of a stale epoch, of a call not
// executing, or of no call writes nothing; an invalid one is rejected.
func testReleaseNotApplied(t *testing.T, s processors.Store) {
	stale := key("release:stale")
	first := admitClaimed(t, s, stale, "executor-1", shortLease)
	waitExpired(t, s, stale)
	cur := mustClaim(t, s, claim(stale, hashA, "executor-2", longLease))[0].Record
	done := key("release:done")
	c := admitClaimed(t, s, done, "executor-1", longLease)
	mustComplete(t, s, processors.Completion{Key: done, Epoch: c.Epoch, Status: processors.StatusSucceeded, Attempt: 1, Seq: 4, Outbox: []byte("x")})
	doneRec := mustGet(t, s, done)
	pending := key("release:pending")
	pendingRec := mustAdmit(t, s, admission(pending, hashA, processors.StatusPending))[0].Record

	applied := mustRelease(t, s,
		processors.Release{Key: stale, Epoch: first.Epoch, After: shortLease},
		processors.Release{Key: done, Epoch: c.Epoch, After: shortLease},
		processors.Release{Key: pending, Epoch: 1, After: shortLease},
		processors.Release{Key: key("release:missing"), Epoch: 1, After: shortLease})
	if slices.Contains(applied, true) {
		t.Errorf("Release applied = %v; want none", applied)
	}
	checkUnchanged(t, s, stale, cur)
	checkUnchanged(t, s, done, doneRec)
	checkUnchanged(t, s, pending, pendingRec)

	for _, r := range []processors.Release{
		{Key: stale, Epoch: 0, After: shortLease},
		{Key: stale, Epoch: cur.Epoch, After: -time.Second},
		{Key: stale, Epoch: cur.Epoch, Sent: strings.Repeat("f", 513)},
		{Key: stale, Epoch: cur.Epoch, Attempt: -1},
	} {
		if _, err := s.Release(t.Context(), []processors.Release{r}); !errors.Is(err, processors.ErrRejected) {
			t.Errorf("Release(epoch %d, after %v) = %v; want ErrRejected", r.Epoch, r.After, err)
		}
	}
	checkUnchanged(t, s, stale, cur)
}

// ---------------------------------------------------------------- Complete

func testCompleteApplied(t *testing.T, s processors.Store) {
	for _, st := range doneStatuses {
		t.Run(string(st), func(t *testing.T) {
			k := key("complete:" + string(st))
			c := admitClaimed(t, s, k, "executor-1", longLease)
			comp := processors.Completion{
				Key: k, Epoch: c.Epoch, Status: st, Attempt: 2,
				Result: []byte(`{"refund_id":"re_1"}`), Seq: 4, Outbox: []byte(`[{"seq":3},{"seq":4}]`),
			}
			before := time.Now()
			if applied := mustComplete(t, s, comp); !applied[0] {
				t.Fatalf("Complete(current epoch) applied = false; want true")
			}
			after := time.Now()

			want := c
			want.Status = st
			want.Attempt = 2
			want.Result = comp.Result
			want.Seq = 4
			want.Outbox = comp.Outbox
			want.LeaseOwner = ""
			got := mustGet(t, s, k)
			if diff := cmp.Diff(want, got, ignoreStoreSet, equateEmpty); diff != "" {
				t.Errorf("Get after Complete mismatch (-want +got):\n%s", diff)
			}
			if !got.LeaseUntil.IsZero() {
				t.Errorf("LeaseUntil = %v; want zero (lease cleared)", got.LeaseUntil)
			}
			checkWithin(t, "UpdatedAt", got.UpdatedAt, before, after)
			if !got.Unlogged() {
				t.Errorf("Unlogged() = false after Complete wrote seq 4 over logged %d; want true", got.LoggedSeq)
			}
			for _, e := range mustExpired(t, s, 100) {
				if e.Key == k {
					t.Errorf("Expired lists completed %v", k)
				}
			}
		})
	}
}

func testCompleteFenced(t *testing.T, s processors.Store) {
	done := func(k ledger.CallKey, epoch int64) processors.Completion {
		return processors.Completion{Key: k, Epoch: epoch, Status: processors.StatusSucceeded, Attempt: 1, Result: []byte("late"), Seq: 9, Outbox: []byte("late")}
	}
	tests := []struct {
		name  string
		setup func(t *testing.T, k ledger.CallKey) int64 // returns the epoch to complete with
	}{
		{"epoch behind", func(t *testing.T, k ledger.CallKey) int64 {
			return admitClaimed(t, s, k, "executor-1", longLease).Epoch - 1
		}},
		{"epoch ahead", func(t *testing.T, k ledger.CallKey) int64 {
			return admitClaimed(t, s, k, "executor-1", longLease).Epoch + 1
		}},
		{"never claimed", func(t *testing.T, k ledger.CallKey) int64 {
			mustAdmit(t, s, admission(k, hashA, processors.StatusAuthorized))
			return 0
		}},
		{"pending", func(t *testing.T, k ledger.CallKey) int64 {
			mustAdmit(t, s, admission(k, hashA, processors.StatusPending))
			return 0
		}},
		{"already completed", func(t *testing.T, k ledger.CallKey) int64 {
			c := admitClaimed(t, s, k, "executor-1", longLease)
			mustComplete(t, s, processors.Completion{Key: k, Epoch: c.Epoch, Status: processors.StatusFailed, Attempt: 1, Result: []byte("first"), Seq: 4})
			return c.Epoch
		}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			k := key("fenced:" + tc.name)
			epoch := tc.setup(t, k)
			before := mustGet(t, s, k)
			if applied := mustComplete(t, s, done(k, epoch)); applied[0] {
				t.Errorf("Complete(%s, epoch %d) applied = true; want false", tc.name, epoch)
			}
			checkUnchanged(t, s, k, before)
		})
	}
	t.Run("missing", func(t *testing.T) {
		if applied := mustComplete(t, s, done(key("fenced:missing"), 1)); applied[0] {
			t.Errorf("Complete(missing) applied = true; want false")
		}
		if _, err := s.Get(t.Context(), key("fenced:missing")); !errors.Is(err, processors.ErrNotFound) {
			t.Errorf("Get after Complete(missing) = %v; want ErrNotFound", err)
		}
	})
}

func testCompleteInvalidStatus(t *testing.T, s processors.Store) {
	k := key("complete-invalid")
	c := admitClaimed(t, s, k, "executor-1", longLease)
	for _, st := range []processors.Status{"", processors.StatusExecuting, processors.StatusAuthorized, processors.StatusPending, "bogus"} {
		t.Run(string(st), func(t *testing.T) {
			_, err := s.Complete(t.Context(), []processors.Completion{{Key: k, Epoch: c.Epoch, Status: st, Attempt: 1, Seq: 4}})
			if !errors.Is(err, processors.ErrRejected) {
				t.Errorf("Complete(status %q) = %v; want an error wrapping ErrRejected", st, err)
			}
			checkUnchanged(t, s, k, c)
		})
	}
}

func testCompleteIntraBatch(t *testing.T, s processors.Store) {
	k := key("complete-intra")
	c := admitClaimed(t, s, k, "executor-1", longLease)
	first := processors.Completion{Key: k, Epoch: c.Epoch, Status: processors.StatusSucceeded, Attempt: 1, Result: []byte("first"), Seq: 4}
	second := processors.Completion{Key: k, Epoch: c.Epoch, Status: processors.StatusFailed, Attempt: 2, Result: []byte("second"), Seq: 5}
	got := mustComplete(t, s, first, second)
	if !slices.Equal(got, []bool{true, false}) {
		t.Errorf("Complete(same epoch twice) = %v; want [true false]", got)
	}
	if r := mustGet(t, s, k); r.Status != processors.StatusSucceeded || string(r.Result) != "first" || r.Seq != 4 {
		t.Errorf("Get = status %q result %q seq %d; want succeeded \"first\" 4", r.Status, r.Result, r.Seq)
	}
}

func testCompleteBatchOrder(t *testing.T, s processors.Store) {
	c1 := admitClaimed(t, s, key("cb:1"), "executor-1", longLease)
	c2 := admitClaimed(t, s, key("cb:2"), "executor-1", longLease)
	c3 := admitClaimed(t, s, key("cb:3"), "executor-1", longLease)
	comp := func(k ledger.CallKey, epoch int64) processors.Completion {
		return processors.Completion{Key: k, Epoch: epoch, Status: processors.StatusSucceeded, Attempt: 1, Seq: 4}
	}
	got := mustComplete(t, s,
		comp(key("cb:missing"), 1),
		comp(c3.Key, c3.Epoch),
		comp(c2.Key, c2.Epoch+5),
		comp(c1.Key, c1.Epoch),
	)
	if want := []bool{false, true, false, true}; !slices.Equal(got, want) {
		t.Errorf("Complete batch = %v; want %v", got, want)
	}
	for _, tc := range []struct {
		k    ledger.CallKey
		want processors.Status
	}{
		{c1.Key, processors.StatusSucceeded},
		{c2.Key, processors.StatusExecuting},
		{c3.Key, processors.StatusSucceeded},
	} {
		if r := mustGet(t, s, tc.k); r.Status != tc.want {
			t.Errorf("Get(%v) status = %q; want %q", tc.k, r.Status, tc.want)
		}
	}
}

// ---------------------------------------------------------------- MarkLogged

func testMarkLoggedMonotonic(t *testing.T, s processors.Store) {
	k := key("logged")
	admitted := mustAdmit(t, s, admission(k, hashA, processors.StatusAuthorized))[0].Record
	if !admitted.Unlogged() {
		t.Fatalf("Unlogged() after Admit with an outbox = false; want true")
	}

	steps := []struct {
		name         string
		markSeq      int64
		wantLogged   int64
		wantUnlogged bool
	}{
		{"partial", 1, 1, true},
		{"up to seq", 2, 2, false},
		{"stale mark", 1, 2, false},
		{"zero mark", 0, 2, false},
	}
	for _, st := range steps {
		mustMarkLogged(t, s, processors.Logged{Key: k, Seq: st.markSeq})
		r := mustGet(t, s, k)
		if r.LoggedSeq != st.wantLogged || r.Unlogged() != st.wantUnlogged {
			t.Errorf("%s: MarkLogged(%d) -> LoggedSeq %d Unlogged %v; want %d %v", st.name, st.markSeq, r.LoggedSeq, r.Unlogged(), st.wantLogged, st.wantUnlogged)
		}
		// MarkLogged touches nothing else, UpdatedAt included: it dates
		// the call's last step, and Unlogged's olderThan counts from it.
		want := admitted
		want.LoggedSeq = st.wantLogged
		if diff := cmp.Diff(want, r, equateEmpty); diff != "" {
			t.Errorf("%s: record mismatch (-want +got):\n%s", st.name, diff)
		}
	}

	// The next step's outbox is unlogged again until marked.
	mustClaim(t, s, claim(k, hashA, "executor-1", longLease))
	mustComplete(t, s, processors.Completion{Key: k, Epoch: 1, Status: processors.StatusSucceeded, Attempt: 1, Seq: 4, Outbox: []byte("step")})
	if r := mustGet(t, s, k); !r.Unlogged() || r.LoggedSeq != 2 {
		t.Errorf("after Complete: Unlogged %v LoggedSeq %d; want true 2", r.Unlogged(), r.LoggedSeq)
	}
	mustMarkLogged(t, s, processors.Logged{Key: k, Seq: 4})
	if r := mustGet(t, s, k); r.Unlogged() || r.LoggedSeq != 4 {
		t.Errorf("after MarkLogged(4): Unlogged %v LoggedSeq %d; want false 4", r.Unlogged(), r.LoggedSeq)
	}
}

func testMarkLoggedBatch(t *testing.T, s processors.Store) {
	k1, k2 := key("logged:1"), key("logged:2")
	a1 := admission(k1, hashA, processors.StatusAuthorized)
	a1.Seq = 9
	a2 := admission(k2, hashA, processors.StatusAuthorized)
	a2.Seq = 9
	mustAdmit(t, s, a1, a2)
	// Same key several times in one batch: the highest wins, whatever
	// the order. A missing key is not an error.
	mustMarkLogged(t, s,
		processors.Logged{Key: k1, Seq: 3},
		processors.Logged{Key: k2, Seq: 2},
		processors.Logged{Key: k1, Seq: 5},
		processors.Logged{Key: key("logged:missing"), Seq: 7},
		processors.Logged{Key: k1, Seq: 4},
	)
	if r := mustGet(t, s, k1); r.LoggedSeq != 5 {
		t.Errorf("Get(k1).LoggedSeq = %d; want 5", r.LoggedSeq)
	}
	if r := mustGet(t, s, k2); r.LoggedSeq != 2 {
		t.Errorf("Get(k2).LoggedSeq = %d; want 2", r.LoggedSeq)
	}
	if _, err := s.Get(t.Context(), key("logged:missing")); !errors.Is(err, processors.ErrNotFound) {
		t.Errorf("Get(missing) after MarkLogged = %v; want ErrNotFound", err)
	}
}

// ---------------------------------------------------------------- Unlogged

// completeUnlogged admits k, logs the admission's events, claims and
// completes it as st with a new outbox (seq 4) that is not logged: a step
// whose Kafka transaction aborted. It returns the record.
func completeUnlogged(t *testing.T, s processors.Store, k ledger.CallKey, st processors.Status) processors.Record {
	t.Helper()
	c := admitClaimed(t, s, k, "executor-1", longLease)
	mustMarkLogged(t, s, processors.Logged{Key: k, Seq: 2})
	comp := processors.Completion{Key: k, Epoch: c.Epoch, Status: st, Attempt: 1, Result: []byte(`{"ok":true}`), Seq: 4, Outbox: []byte(`[{"seq":3},{"seq":4}]`)}
	if applied := mustComplete(t, s, comp); !applied[0] {
		t.Fatalf("Complete(%v, %s) applied = false; want true", k, st)
	}
	return mustGet(t, s, k)
}

// testUnloggedOlderThan: a done, unlogged record is listed once it was
// last updated more than olderThan ago, and not before.
func testUnloggedOlderThan(t *testing.T, s processors.Store) {
	k := key("unlogged:age")
	done := completeUnlogged(t, s, k, processors.StatusSucceeded)

	// Updated just now: not more than an hour ago, whatever the clocks.
	if got := mustUnlogged(t, s, time.Hour, 100); len(got) != 0 {
		t.Errorf("Unlogged(1h) right after Complete = %v; want none (too recent)", keysOf(got))
	}
	got := waitUnlogged(t, s, []ledger.CallKey{k})
	if diff := cmp.Diff(done, got[0], equateEmpty); diff != "" {
		t.Errorf("Unlogged record differs from Get's (-get +unlogged):\n%s", diff)
	}
	// Still too recent for an hour, even while old enough for the short age.
	if got := mustUnlogged(t, s, time.Hour, 100); len(got) != 0 {
		t.Errorf("Unlogged(1h) = %v; want none", keysOf(got))
	}
}

// testUnloggedMarkLogged: only a MarkLogged up to the record's seq takes
// it off the list, and it does not make the record look recent.
func testUnloggedMarkLogged(t *testing.T, s processors.Store) {
	k := key("unlogged:marked")
	done := completeUnlogged(t, s, k, processors.StatusFailed)
	waitUnlogged(t, s, []ledger.CallKey{k})

	mustMarkLogged(t, s, processors.Logged{Key: k, Seq: 3})
	got := mustUnlogged(t, s, unloggedAge, 100)
	if len(got) != 1 || got[0].LoggedSeq != 3 {
		t.Fatalf("Unlogged after MarkLogged(3) of seq 4 = %v; want %v with LoggedSeq 3", got, k)
	}
	// MarkLogged does not move UpdatedAt: the record stays old enough.
	if !got[0].UpdatedAt.Equal(done.UpdatedAt) {
		t.Errorf("UpdatedAt after MarkLogged = %v; want unchanged %v", got[0].UpdatedAt, done.UpdatedAt)
	}

	mustMarkLogged(t, s, processors.Logged{Key: k, Seq: 4})
	if got := mustUnlogged(t, s, 0, 100); len(got) != 0 {
		t.Errorf("Unlogged(0) after MarkLogged(4) = %v; want none", keysOf(got))
	}
}

// testUnloggedOrderAndLimit: oldest update first, whatever the keys'
// order, and at most limit.
func testUnloggedOrderAndLimit(t *testing.T, s processors.Store) {
	kc, ka, kb := key("unlogged:c"), key("unlogged:a"), key("unlogged:b")
	// Updated in this order, each in its own transaction: c, a (an
	// admission denied by the intake, never claimed), b.
	completeUnlogged(t, s, kc, processors.StatusSucceeded)
	mustAdmit(t, s, admission(ka, hashA, processors.StatusDenied))
	completeUnlogged(t, s, kb, processors.StatusOutcomeUnknown)
	recs := []processors.Record{mustGet(t, s, kc), mustGet(t, s, ka), mustGet(t, s, kb)}
	// The expected order comes from the stored timestamps (a store's
	// clock may give two steps the same one; then the key decides).
	slices.SortStableFunc(recs, func(x, y processors.Record) int {
		if c := x.UpdatedAt.Compare(y.UpdatedAt); c != 0 {
			return c
		}
		return strings.Compare(x.Key.IdempotencyKey, y.Key.IdempotencyKey)
	})
	want := keysOf(recs)

	got := waitUnlogged(t, s, want)
	if diff := cmp.Diff(recs, got, equateEmpty); diff != "" {
		t.Errorf("Unlogged(%v, 100) records mismatch (-get +unlogged):\n%s", unloggedAge, diff)
	}
	if got := keysOf(mustUnlogged(t, s, unloggedAge, 2)); !slices.Equal(got, want[:2]) {
		t.Errorf("Unlogged(%v, 2) keys = %v; want %v", unloggedAge, got, want[:2])
	}
	for _, limit := range []int{0, -1} {
		if got := mustUnlogged(t, s, unloggedAge, limit); len(got) != 0 {
			t.Errorf("Unlogged(%v, %d) = %d records; want none", unloggedAge, limit, len(got))
		}
	}
}

// testUnloggedAfter: from a Cursor (a listed record's place) Unlogged
// lists what follows it, in its order: pages of a short limit, each after
// the last, list every record once, records that share an update time
// (one batch's) included; and a cursor whose record was logged since
// still marks its place, as a sweep's does once its page is appended.
func testUnloggedAfter(t *testing.T, s processors.Store) {
	// Three batches; the first one's three records share its time, so
	// that the first page ends among them.
	n := 0
	for b, size := range []int{3, 1, 2} {
		var as []processors.Admission
		for i := range size {
			as = append(as, admission(key(fmt.Sprintf("after:%d-%d", b, i)), hashA, processors.StatusDenied))
		}
		mustAdmit(t, s, as...)
		n += size
	}
	// The store's own order is the reference: the order of keys among
	// ties is the store's (a database's collation).
	var all []processors.Record
	waitFor(t, pollTimeout, func() error {
		if all = mustUnlogged(t, s, unloggedAge, 100); len(all) != n {
			return fmt.Errorf("Unlogged(%v, 100) = %d records; want %d", unloggedAge, len(all), n)
		}
		return nil
	})
	const limit = 2
	var (
		got   []ledger.CallKey
		after processors.Cursor
	)
	for range n {
		page := mustUnloggedAfter(t, s, unloggedAge, after, limit)
		got = append(got, keysOf(page)...)
		if len(page) < limit {
			break
		}
		after = page[len(page)-1].Cursor()
	}
	if want := keysOf(all); !slices.Equal(got, want) {
		t.Errorf("Unlogged(%v, after the last, %d) page by page = %v; want %v", unloggedAge, limit, got, want)
	}
	if rest := mustUnloggedAfter(t, s, unloggedAge, all[n-1].Cursor(), 100); len(rest) != 0 {
		t.Errorf("Unlogged after the last record = %v; want none", keysOf(rest))
	}
	mustMarkLogged(t, s, processors.Logged{Key: all[1].Key, Seq: all[1].Seq})
	if rest, want := keysOf(mustUnloggedAfter(t, s, unloggedAge, all[1].Cursor(), 100)), keysOf(all[2:]); !slices.Equal(rest, want) {
		t.Errorf("Unlogged after a record logged since = %v; want %v", rest, want)
	}
}

// testUnloggedScope: records in every status but executing are listed
// while their events are not known to be in the log: a step that wrote
// them may have failed to publish (an intake whose Kafka transaction
// aborted, an approval recorded and then not published). Executing
// records never are, even with their admission's events unlogged and
// their lease expired: their executor (or its reclaimer) writes the
// outbox again at completion. A record whose events are all logged, or
// that has none, has nothing to append.
func testUnloggedScope(t *testing.T, s processors.Store) {
	// Not listed; created first, so that they are older than the listed
	// ones and a store that listed them could never match want.
	admitClaimed(t, s, key("never:executing"), "executor-1", longLease)
	admitClaimed(t, s, key("never:lease-expired"), "executor-1", shortLease)
	noEvents := admission(key("never:denied-no-events"), hashA, processors.StatusDenied)
	noEvents.Seq, noEvents.Outbox = 0, nil
	mustAdmit(t, s, noEvents)
	logged := completeUnlogged(t, s, key("never:logged"), processors.StatusSucceeded)
	mustMarkLogged(t, s, processors.Logged{Key: logged.Key, Seq: logged.Seq})
	for _, st := range []processors.Status{processors.StatusDenied, processors.StatusAuthorized, processors.StatusPending} {
		a := admission(key("never:logged-"+string(st)), hashA, st)
		mustAdmit(t, s, a)
		mustMarkLogged(t, s, processors.Logged{Key: a.Key, Seq: a.Seq})
	}

	// Listed: admitted and never logged, in each status Admit takes, and
	// every done status, completed and unlogged.
	var want []ledger.CallKey
	for _, st := range []processors.Status{processors.StatusAuthorized, processors.StatusPending, processors.StatusDenied} {
		k := key("listed:admitted-" + string(st))
		mustAdmit(t, s, admission(k, hashA, st))
		want = append(want, k)
	}
	for _, st := range doneStatuses {
		k := key("listed:" + string(st))
		completeUnlogged(t, s, k, st)
		want = append(want, k)
	}

	waitFor(t, pollTimeout, func() error {
		got := keysOf(mustUnlogged(t, s, unloggedAge, 100))
		if !slices.Equal(sortedKeys(got), sortedKeys(want)) {
			return fmt.Errorf("Unlogged(%v, 100) keys = %v; want (in any order) %v", unloggedAge, got, want)
		}
		return nil
	})
	// The lease had long expired by then: executing is left out by
	// status, not by age.
	if r := mustGet(t, s, key("never:lease-expired")); r.Status != processors.StatusExecuting || !r.Unlogged() {
		t.Errorf("never:lease-expired = status %q unlogged %v; want executing with unlogged events (the test's premise)", r.Status, r.Unlogged())
	}
}

// testUnloggedMoved: a move writes new events; until they are marked
// logged the record is listed, as the move wrote it, once old enough.
func testUnloggedMoved(t *testing.T, s processors.Store) {
	k := key("unlogged:moved")
	mustAdmit(t, s, admission(k, hashA, processors.StatusPending))
	mustMarkLogged(t, s, processors.Logged{Key: k, Seq: 2})
	if got := mustUnlogged(t, s, 0, 100); len(got) != 0 {
		t.Fatalf("Unlogged(0) with every event logged = %v; want none (the test's premise)", keysOf(got))
	}
	m := processors.Move{Key: k, From: processors.StatusPending, FromSeq: 2, To: processors.StatusAuthorized, Seq: 4, Outbox: []byte(`[{"seq":3},{"seq":4}]`)}
	if applied := mustMove(t, s, m); !applied[0] {
		t.Fatalf("Move(%v) applied = false; want true", k)
	}
	// The move dates the record: not listed for an age it has not reached.
	if got := mustUnlogged(t, s, time.Hour, 100); len(got) != 0 {
		t.Errorf("Unlogged(1h) right after Move = %v; want none (too recent)", keysOf(got))
	}
	got := waitUnlogged(t, s, []ledger.CallKey{k})[0]
	if got.Status != m.To || got.Seq != m.Seq || !bytes.Equal(got.Outbox, m.Outbox) || got.LoggedSeq != 2 {
		t.Errorf("Unlogged record = status %q seq %d outbox %s logged %d; want %q %d %s 2", got.Status, got.Seq, got.Outbox, got.LoggedSeq, m.To, m.Seq, m.Outbox)
	}
	mustMarkLogged(t, s, processors.Logged{Key: k, Seq: m.Seq})
	if got := mustUnlogged(t, s, 0, 100); len(got) != 0 {
		t.Errorf("Unlogged(0) after MarkLogged(%d) = %v; want none", m.Seq, keysOf(got))
	}
}

func sortedKeys(ks []ledger.CallKey) []ledger.CallKey {
	return slices.SortedFunc(slices.Values(ks), func(x, y ledger.CallKey) int {
		return strings.Compare(x.TenantID+"\x00"+x.IdempotencyKey, y.TenantID+"\x00"+y.IdempotencyKey)
	})
}

// ---------------------------------------------------------------- Move

// move is the move of k from st at seq 2 (an admission's) to to at seq 3.
func move(k ledger.CallKey, st, to processors.Status) processors.Move {
	return processors.Move{Key: k, From: st, FromSeq: 2, To: to, Seq: 3, Outbox: []byte(`[{"seq":3}]`)}
}

// testMoveApplied: a move from the record's status and seq writes To,
// Seq, Outbox and UpdatedAt and nothing else, and the call then behaves
// as its new status says.
func testMoveApplied(t *testing.T, s processors.Store) {
	tests := []struct {
		name      string
		from, to  processors.Status
		wantClaim processors.ClaimOutcome
	}{
		{"approved", processors.StatusPending, processors.StatusAuthorized, processors.Claimed},
		{"rejected", processors.StatusPending, processors.StatusRejected, processors.Finished},
		{"approval expired", processors.StatusPending, processors.StatusExpired, processors.Finished},
		{"deadline passed", processors.StatusAuthorized, processors.StatusExpired, processors.Finished},
		{"sent for approval", processors.StatusAuthorized, processors.StatusPending, processors.NotReady},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			k := key("move:" + tc.name)
			mustAdmit(t, s, admission(k, hashA, tc.from))
			// Partly logged: Move must leave LoggedSeq alone.
			mustMarkLogged(t, s, processors.Logged{Key: k, Seq: 1})
			admitted := mustGet(t, s, k)
			m := processors.Move{Key: k, From: tc.from, FromSeq: 2, To: tc.to, Seq: 5, Outbox: []byte(`[{"seq":3},{"seq":4},{"seq":5}]`)}

			before := time.Now()
			applied := mustMove(t, s, m)
			after := time.Now()
			if !applied[0] {
				t.Fatalf("Move(%s -> %s) applied = false; want true", tc.from, tc.to)
			}
			want := admitted
			want.Status, want.Seq, want.Outbox = tc.to, m.Seq, m.Outbox
			got := mustGet(t, s, k)
			if diff := cmp.Diff(want, got, ignoreStoreSet, equateEmpty); diff != "" {
				t.Errorf("Get after Move mismatch (-want +got):\n%s", diff)
			}
			if !got.CreatedAt.Equal(admitted.CreatedAt) || !got.LeaseUntil.IsZero() {
				t.Errorf("CreatedAt %v LeaseUntil %v; want unchanged %v and zero", got.CreatedAt, got.LeaseUntil, admitted.CreatedAt)
			}
			checkWithin(t, "UpdatedAt", got.UpdatedAt, before, after)

			c := mustClaim(t, s, claim(k, hashA, "executor-1", longLease))
			if c[0].Outcome != tc.wantClaim {
				t.Errorf("Claim after Move to %s outcome = %v; want %v", tc.to, c[0].Outcome, tc.wantClaim)
			}
		})
	}
}

// testMoveNotApplied: a move whose record is no longer (or never was) at
// its From status and seq does not apply and changes nothing.
func testMoveNotApplied(t *testing.T, s processors.Store) {
	pending, authorized := processors.StatusPending, processors.StatusAuthorized
	tests := []struct {
		name  string
		setup func(t *testing.T, k ledger.CallKey)
		m     func(k ledger.CallKey) processors.Move
	}{
		{"other status", func(t *testing.T, k ledger.CallKey) {
			mustAdmit(t, s, admission(k, hashA, pending))
		}, func(k ledger.CallKey) processors.Move { return move(k, authorized, processors.StatusExpired) }},
		{"seq behind", func(t *testing.T, k ledger.CallKey) {
			mustAdmit(t, s, admission(k, hashA, pending))
		}, func(k ledger.CallKey) processors.Move {
			m := move(k, pending, authorized)
			m.FromSeq = 1
			return m
		}},
		{"seq ahead", func(t *testing.T, k ledger.CallKey) {
			mustAdmit(t, s, admission(k, hashA, pending))
		}, func(k ledger.CallKey) processors.Move {
			m := move(k, pending, authorized)
			m.FromSeq, m.Seq = 3, 4
			return m
		}},
		{"already applied", func(t *testing.T, k ledger.CallKey) {
			mustAdmit(t, s, admission(k, hashA, pending))
			if applied := mustMove(t, s, move(k, pending, authorized)); !applied[0] {
				t.Fatalf("first Move applied = false; want true")
			}
		}, func(k ledger.CallKey) processors.Move { return move(k, pending, authorized) }},
		{"other move applied", func(t *testing.T, k ledger.CallKey) {
			mustAdmit(t, s, admission(k, hashA, pending))
			if applied := mustMove(t, s, move(k, pending, processors.StatusRejected)); !applied[0] {
				t.Fatalf("first Move applied = false; want true")
			}
		}, func(k ledger.CallKey) processors.Move { return move(k, pending, authorized) }},
		{"claimed meanwhile", func(t *testing.T, k ledger.CallKey) {
			admitClaimed(t, s, k, "executor-1", longLease)
		}, func(k ledger.CallKey) processors.Move { return move(k, authorized, processors.StatusExpired) }},
		{"completed meanwhile", func(t *testing.T, k ledger.CallKey) {
			c := admitClaimed(t, s, k, "executor-1", longLease)
			mustComplete(t, s, processors.Completion{Key: k, Epoch: c.Epoch, Status: processors.StatusSucceeded, Attempt: 1, Seq: 2})
		}, func(k ledger.CallKey) processors.Move { return move(k, authorized, processors.StatusExpired) }},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			k := key("move-stale:" + tc.name)
			tc.setup(t, k)
			before := mustGet(t, s, k)
			if applied := mustMove(t, s, tc.m(k)); applied[0] {
				t.Errorf("Move(%s) applied = true; want false", tc.name)
			}
			checkUnchanged(t, s, k, before)
		})
	}
	t.Run("missing", func(t *testing.T) {
		k := key("move-stale:missing")
		if applied := mustMove(t, s, move(k, pending, authorized)); applied[0] {
			t.Errorf("Move(missing) applied = true; want false")
		}
		if _, err := s.Get(t.Context(), k); !errors.Is(err, processors.ErrNotFound) {
			t.Errorf("Get after Move(missing) = %v; want ErrNotFound (Move must not create)", err)
		}
	})
}

// testMoveResult: a move to succeeded that carries a result (a call the
// reconciler settles on its status lookup's answer) replaces the record's
// result; one without leaves it as it was, and so does every batch
// mixing both.
func testMoveResult(t *testing.T, s processors.Store) {
	with, without := key("move-result:with"), key("move-result:without")
	var before processors.Record
	for _, k := range []ledger.CallKey{with, without} {
		before = completeUnlogged(t, s, k, processors.StatusOutcomeUnknown)
	}
	m := func(k ledger.CallKey, result []byte) processors.Move {
		return processors.Move{Key: k, From: processors.StatusOutcomeUnknown, FromSeq: before.Seq, FromUndoMarks: before.UndoMarks,
			To: processors.StatusSucceeded, Seq: before.Seq + 1, Outbox: []byte(`[{"seq":5}]`), Result: result}
	}
	if applied := mustMove(t, s, m(with, []byte(`{"ticket_id":"tk_1"}`)), m(without, nil)); !applied[0] || !applied[1] {
		t.Fatalf("Move to succeeded applied = %v; want both", applied)
	}
	for k, want := range map[ledger.CallKey]string{with: `{"ticket_id":"tk_1"}`, without: `{"ok":true}`} {
		if got := mustGet(t, s, k); got.Status != processors.StatusSucceeded || string(got.Result) != want {
			t.Errorf("Get(%v) after Move = %s, result %s; want succeeded, result %s", k, got.Status, got.Result, want)
		}
	}
}

// testMoveInvalid: moves no store may apply are refused as the data's
// fault, the whole batch with them, whatever the record's state.
func testMoveInvalid(t *testing.T, s processors.Store) {
	k := key("move-invalid")
	r := mustAdmit(t, s, admission(k, hashA, processors.StatusPending))[0].Record
	valid := move(k, processors.StatusPending, processors.StatusAuthorized)
	tests := []struct {
		name string
		edit func(m *processors.Move)
	}{
		{"unknown from", func(m *processors.Move) { m.From = "bogus" }},
		{"unknown to", func(m *processors.Move) { m.To = "bogus" }},
		{"empty from", func(m *processors.Move) { m.From = "" }},
		{"empty to", func(m *processors.Move) { m.To = "" }},
		{"to executing", func(m *processors.Move) { m.To = processors.StatusExecuting }},
		{"from executing", func(m *processors.Move) { m.From = processors.StatusExecuting }},
		{"from succeeded", func(m *processors.Move) { m.From = processors.StatusSucceeded }},
		{"from denied", func(m *processors.Move) { m.From = processors.StatusDenied }},
		{"from rejected", func(m *processors.Move) { m.From, m.To = processors.StatusRejected, processors.StatusExpired }},
		{"seq unchanged", func(m *processors.Move) { m.Seq = m.FromSeq }},
		{"seq behind", func(m *processors.Move) { m.Seq = m.FromSeq - 1 }},
		{"a result, not to succeeded", func(m *processors.Move) { m.Result = []byte(`{"x":1}`) }},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			bad := valid
			tc.edit(&bad)
			// The valid move first: refusing the batch must undo nothing,
			// because nothing of it ran.
			_, err := s.Move(t.Context(), []processors.Move{valid, bad})
			if !errors.Is(err, processors.ErrRejected) {
				t.Errorf("Move(%s) = %v; want an error wrapping ErrRejected", tc.name, err)
			}
			checkUnchanged(t, s, k, r)
		})
	}
}

// testMoveIntraBatch: moves of one key in one batch apply in order, each
// seeing the ones before it.
func testMoveIntraBatch(t *testing.T, s processors.Store) {
	pending, authorized := processors.StatusPending, processors.StatusAuthorized
	then := func(k ledger.CallKey, from processors.Status, fromSeq int64, to processors.Status, seq int64) processors.Move {
		return processors.Move{Key: k, From: from, FromSeq: fromSeq, To: to, Seq: seq, Outbox: fmt.Appendf(nil, `[{"seq":%d}]`, seq)}
	}
	tests := []struct {
		name       string
		moves      func(k ledger.CallKey) []processors.Move
		want       []bool
		wantStatus processors.Status
		wantSeq    int64
	}{
		{"chained", func(k ledger.CallKey) []processors.Move {
			return []processors.Move{then(k, pending, 2, authorized, 3), then(k, authorized, 3, processors.StatusExpired, 4)}
		}, []bool{true, true}, processors.StatusExpired, 4},
		{"second from the old state", func(k ledger.CallKey) []processors.Move {
			return []processors.Move{then(k, pending, 2, authorized, 3), then(k, pending, 2, processors.StatusRejected, 3)}
		}, []bool{true, false}, authorized, 3},
		{"first stale, second applies", func(k ledger.CallKey) []processors.Move {
			return []processors.Move{then(k, authorized, 2, processors.StatusExpired, 3), then(k, pending, 2, processors.StatusRejected, 3)}
		}, []bool{false, true}, processors.StatusRejected, 3},
		{"out of order", func(k ledger.CallKey) []processors.Move {
			return []processors.Move{then(k, authorized, 3, processors.StatusExpired, 4), then(k, pending, 2, authorized, 3)}
		}, []bool{false, true}, authorized, 3},
		{"three", func(k ledger.CallKey) []processors.Move {
			return []processors.Move{then(k, pending, 2, authorized, 3), then(k, authorized, 3, pending, 5), then(k, pending, 5, processors.StatusRejected, 6)}
		}, []bool{true, true, true}, processors.StatusRejected, 6},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			k := key("move-intra:" + tc.name)
			mustAdmit(t, s, admission(k, hashA, pending))
			if got := mustMove(t, s, tc.moves(k)...); !slices.Equal(got, tc.want) {
				t.Errorf("Move batch = %v; want %v", got, tc.want)
			}
			r := mustGet(t, s, k)
			if wantOutbox := fmt.Sprintf(`[{"seq":%d}]`, tc.wantSeq); r.Status != tc.wantStatus || r.Seq != tc.wantSeq || string(r.Outbox) != wantOutbox {
				t.Errorf("Get = status %q seq %d outbox %s; want %q %d %s", r.Status, r.Seq, r.Outbox, tc.wantStatus, tc.wantSeq, wantOutbox)
			}
		})
	}
}

func testMoveBatchOrder(t *testing.T, s processors.Store) {
	pending, authorized := processors.StatusPending, processors.StatusAuthorized
	mustAdmit(t, s,
		admission(key("mb:1"), hashA, pending),
		admission(key("mb:2"), hashA, pending),
		admission(key("mb:3"), hashA, authorized),
	)
	got := mustMove(t, s,
		move(key("mb:missing"), pending, authorized),
		move(key("mb:3"), authorized, processors.StatusExpired),
		move(key("mb:2"), authorized, processors.StatusExpired),
		move(key("mb:1"), pending, processors.StatusRejected),
	)
	if want := []bool{false, true, false, true}; !slices.Equal(got, want) {
		t.Errorf("Move batch = %v; want %v", got, want)
	}
	for _, tc := range []struct {
		k    ledger.CallKey
		want processors.Status
	}{
		{key("mb:1"), processors.StatusRejected},
		{key("mb:2"), pending},
		{key("mb:3"), processors.StatusExpired},
	} {
		if r := mustGet(t, s, tc.k); r.Status != tc.want {
			t.Errorf("Get(%v) status = %q; want %q", tc.k, r.Status, tc.want)
		}
	}
}

// ---------------------------------------------------------------- ByStatus

// sortByUpdate sorts records as ByStatus and Unlogged list them: oldest
// update first, then by key (a store's clock gives one batch's records
// the same time).
func sortByUpdate(rs []processors.Record) {
	slices.SortStableFunc(rs, func(x, y processors.Record) int {
		if c := x.UpdatedAt.Compare(y.UpdatedAt); c != 0 {
			return c
		}
		if c := strings.Compare(x.Key.TenantID, y.Key.TenantID); c != 0 {
			return c
		}
		return strings.Compare(x.Key.IdempotencyKey, y.Key.IdempotencyKey)
	})
}

func testByStatusOrderAndLimit(t *testing.T, s processors.Store) {
	pending := processors.StatusPending
	// Pending records updated in this order, each step its own
	// transaction: c; a with an authorized and a denied record; another
	// tenant's; z and y in one batch (one timestamp: y first, by key).
	other := ledger.CallKey{TenantID: "t_other", IdempotencyKey: "bs:b"}
	mustAdmit(t, s, admission(key("bs:c"), hashA, pending))
	mustAdmit(t, s,
		admission(key("bs:auth"), hashA, processors.StatusAuthorized),
		admission(key("bs:a"), hashA, pending),
		admission(key("bs:denied"), hashA, processors.StatusDenied),
	)
	mustAdmit(t, s, admission(other, hashA, pending))
	mustAdmit(t, s, admission(key("bs:z"), hashA, pending), admission(key("bs:y"), hashA, pending))
	// Not pending any more: moved away, and claimed.
	mustAdmit(t, s, admission(key("bs:approved"), hashA, pending))
	mustMove(t, s, move(key("bs:approved"), pending, processors.StatusAuthorized))
	admitClaimed(t, s, key("bs:executing"), "executor-1", longLease)

	var want []processors.Record
	for _, k := range []ledger.CallKey{key("bs:c"), key("bs:a"), other, key("bs:z"), key("bs:y")} {
		want = append(want, mustGet(t, s, k))
	}
	sortByUpdate(want)
	if ks := keysOf(want); ks[3] != key("bs:y") || ks[4] != key("bs:z") {
		t.Fatalf("stored order %v; want y then z last (one batch, one timestamp)", ks)
	}
	got := mustByStatus(t, s, pending, 100)
	if diff := cmp.Diff(want, got, equateEmpty); diff != "" {
		t.Errorf("ByStatus(pending, 100) mismatch (-want +got):\n%s", diff)
	}
	if got := keysOf(mustByStatus(t, s, pending, 2)); !slices.Equal(got, keysOf(want[:2])) {
		t.Errorf("ByStatus(pending, 2) keys = %v; want %v", got, keysOf(want[:2]))
	}
	for _, limit := range []int{0, -1} {
		if got := mustByStatus(t, s, pending, limit); len(got) != 0 {
			t.Errorf("ByStatus(pending, %d) = %d records; want none", limit, len(got))
		}
	}

	tests := []struct {
		st   processors.Status
		want []ledger.CallKey
	}{
		{processors.StatusAuthorized, []ledger.CallKey{key("bs:auth"), key("bs:approved")}},
		{processors.StatusDenied, []ledger.CallKey{key("bs:denied")}},
		{processors.StatusExecuting, []ledger.CallKey{key("bs:executing")}},
		{processors.StatusSucceeded, []ledger.CallKey{}},
		{"bogus", []ledger.CallKey{}},
	}
	for _, tc := range tests {
		if got := keysOf(mustByStatus(t, s, tc.st, 100)); !slices.Equal(got, tc.want) {
			t.Errorf("ByStatus(%q, 100) keys = %v; want %v", tc.st, got, tc.want)
		}
	}
}

// testByStatusAfter: ByStatus's order, page by page from a cursor: pages
// of 2 through records of which some share an update time (one batch),
// across tenants, for a status listed through the index (pending) and one
// scanned (authorized); a cursor whose record left the status meanwhile
// still places the next page.
func testByStatusAfter(t *testing.T, s processors.Store) {
	other := func(idem string) ledger.CallKey { return ledger.CallKey{TenantID: "t_other", IdempotencyKey: idem} }
	for _, st := range []processors.Status{processors.StatusPending, processors.StatusAuthorized} {
		p := "bsa:" + string(st) + ":"
		mustAdmit(t, s, admission(key(p+"c"), hashA, st))
		mustAdmit(t, s, admission(key(p+"b"), hashA, st), admission(other(p+"a"), hashA, st), admission(key(p+"a"), hashA, st))
		mustAdmit(t, s, admission(key(p+"d"), hashA, st))
		want := mustByStatus(t, s, st, 100)
		var got []processors.Record
		var after processors.Cursor
		for page := 0; page < 10; page++ {
			rs, err := s.ByStatusAfter(t.Context(), st, after, 2)
			if err != nil {
				t.Fatalf("ByStatusAfter(%s, %+v, 2) = %v", st, after, err)
			}
			got = append(got, rs...)
			if len(rs) < 2 {
				break
			}
			after = rs[len(rs)-1].Cursor()
		}
		if !slices.Equal(keysOf(got), keysOf(want)) {
			t.Errorf("ByStatusAfter(%s) pages of 2 = %v; want ByStatus's %v", st, keysOf(got), keysOf(want))
		}
		if rs, err := s.ByStatusAfter(t.Context(), st, processors.Cursor{}, 100); err != nil || !slices.Equal(keysOf(rs), keysOf(want)) {
			t.Errorf("ByStatusAfter(%s, zero cursor) = %v, %v; want ByStatus's %v", st, keysOf(rs), err, keysOf(want))
		}
		// The second record leaves the status; its cursor still places
		// the rest.
		second := want[1]
		mustMove(t, s, move(second.Key, st, processors.StatusDenied))
		rs, err := s.ByStatusAfter(t.Context(), st, second.Cursor(), 100)
		if err != nil || !slices.Equal(keysOf(rs), keysOf(want[2:])) {
			t.Errorf("ByStatusAfter(%s) after a record that left = %v, %v; want %v", st, keysOf(rs), err, keysOf(want[2:]))
		}
	}
}

// testTenantByStatus: one tenant's records in a status, in ByStatus's
// order, however many other tenants' come first; for a status the store
// lists through its index (pending) and for one it scans (authorized).
func testTenantByStatus(t *testing.T, s processors.Store) {
	other := func(idem string) ledger.CallKey { return ledger.CallKey{TenantID: "t_other", IdempotencyKey: idem} }
	for _, st := range []processors.Status{processors.StatusPending, processors.StatusAuthorized} {
		p := "tbs:" + string(st) + ":"
		// The other tenant's first, more of them than the limit.
		mustAdmit(t, s, admission(other(p+"1"), hashA, st), admission(other(p+"2"), hashA, st), admission(other(p+"3"), hashA, st))
		mustAdmit(t, s, admission(key(p+"b"), hashA, st))
		mustAdmit(t, s, admission(key(p+"a"), hashA, st), admission(key(p+"denied"), hashA, processors.StatusDenied))
		want := []ledger.CallKey{key(p + "b"), key(p + "a")}
		got, err := s.TenantByStatus(t.Context(), "t_acme", st, 2)
		if err != nil {
			t.Fatalf("TenantByStatus(t_acme, %s, 2) = %v", st, err)
		}
		if !slices.Equal(keysOf(got), want) {
			t.Errorf("TenantByStatus(t_acme, %s, 2) keys = %v; want %v", st, keysOf(got), want)
		}
		for i, r := range got {
			if diff := cmp.Diff(mustGet(t, s, want[i]), r, equateEmpty); diff != "" {
				t.Errorf("TenantByStatus(t_acme, %s) record %v (-Get +listed):\n%s", st, want[i], diff)
			}
		}
		if got, err := s.TenantByStatus(t.Context(), "t_acme", st, 1); err != nil || !slices.Equal(keysOf(got), want[:1]) {
			t.Errorf("TenantByStatus(t_acme, %s, 1) = %v, %v; want %v", st, keysOf(got), err, want[:1])
		}
		if got, err := s.TenantByStatus(t.Context(), "t_none", st, 10); err != nil || len(got) != 0 {
			t.Errorf("TenantByStatus(t_none, %s) = %v, %v; want none", st, keysOf(got), err)
		}
		if got, err := s.TenantByStatus(t.Context(), "t_acme", st, 0); err != nil || len(got) != 0 {
			t.Errorf("TenantByStatus(t_acme, %s, 0) = %v, %v; want none", st, keysOf(got), err)
		}
	}
}

// testTenantByStatusInterleaved: with several tenants' records
// interleaved in time (some in one batch, so of one update time), each
// tenant's listing is ByStatus's order with the others' left out, at
// every limit, and TenantLatestByStatus's is that order backwards; a
// record that leaves the status leaves its tenant's listing, and one
// that comes back is listed as updated last. t_a is a
// prefix of t_ab and of t_acme, so a store that keys by tenant must keep
// them apart. For a status listed through an index (pending) and one
// scanned (authorized).
func testTenantByStatusInterleaved(t *testing.T, s processors.Store) {
	of := func(tenant, idem string) ledger.CallKey {
		return ledger.CallKey{TenantID: tenant, IdempotencyKey: idem}
	}
	tenants := []string{"t_a", "t_ab", "t_acme"}
	for _, tc := range []struct{ st, via processors.Status }{
		{processors.StatusPending, processors.StatusAuthorized},
		{processors.StatusAuthorized, processors.StatusPending},
	} {
		st := tc.st
		p := "tbsi:" + string(st) + ":"
		mustAdmit(t, s, admission(of("t_ab", p+"x"), hashA, st), admission(of("t_acme", p+"m"), hashA, st), admission(of("t_a", p+"y"), hashA, st))
		mustAdmit(t, s, admission(of("t_acme", p+"c"), hashA, st), admission(of("t_ab", p+"q"), hashA, st), admission(of("t_acme", p+"b"), hashA, st))
		mustAdmit(t, s, admission(of("t_a", p+"z"), hashA, st), admission(of("t_acme", p+"gone"), hashA, st))
		mustAdmit(t, s, admission(of("t_acme", p+"a"), hashA, st), admission(of("t_ab", p+"w"), hashA, processors.StatusDenied))
		// m leaves the status and comes back: listed as updated last;
		// gone leaves it.
		mustMove(t, s, move(of("t_acme", p+"m"), st, tc.via), move(of("t_acme", p+"gone"), st, processors.StatusDenied))
		mustMove(t, s, processors.Move{Key: of("t_acme", p+"m"), From: tc.via, FromSeq: 3, To: st, Seq: 4})

		all := mustByStatus(t, s, st, 100)
		want := map[string][]ledger.CallKey{
			"t_a":    {of("t_a", p+"y"), of("t_a", p+"z")},
			"t_ab":   {of("t_ab", p+"x"), of("t_ab", p+"q")},
			"t_acme": {of("t_acme", p+"b"), of("t_acme", p+"c"), of("t_acme", p+"a"), of("t_acme", p+"m")},
		}
		for _, tenant := range tenants {
			var fromAll []ledger.CallKey
			for _, r := range all {
				if r.Key.TenantID == tenant {
					fromAll = append(fromAll, r.Key)
				}
			}
			if !slices.Equal(fromAll, want[tenant]) {
				t.Errorf("ByStatus(%s) keys of %s = %v; want %v", st, tenant, fromAll, want[tenant])
			}
			for limit := 1; limit <= len(want[tenant])+1; limit++ {
				got, err := s.TenantByStatus(t.Context(), tenant, st, limit)
				if err != nil {
					t.Fatalf("TenantByStatus(%s, %s, %d) = %v", tenant, st, limit, err)
				}
				w := want[tenant][:min(limit, len(want[tenant]))]
				if !slices.Equal(keysOf(got), w) {
					t.Errorf("TenantByStatus(%s, %s, %d) keys = %v; want %v", tenant, st, limit, keysOf(got), w)
				}
				// Newest first: the same order backwards, from its end.
				if got, err = s.TenantLatestByStatus(t.Context(), tenant, st, processors.Cursor{}, limit); err != nil {
					t.Fatalf("TenantLatestByStatus(%s, %s, %d) = %v", tenant, st, limit, err)
				}
				w = slices.Clone(want[tenant])
				slices.Reverse(w)
				w = w[:min(limit, len(w))]
				if !slices.Equal(keysOf(got), w) {
					t.Errorf("TenantLatestByStatus(%s, %s, %d) keys = %v; want %v", tenant, st, limit, keysOf(got), w)
				}
				for _, r := range got {
					if diff := cmp.Diff(mustGet(t, s, r.Key), r, equateEmpty); diff != "" {
						t.Errorf("TenantLatestByStatus(%s, %s) record %v (-Get +listed):\n%s", tenant, st, r.Key, diff)
					}
				}
				// Paged, each page from before the last one's last
				// record: the same listing, each record once.
				var paged []ledger.CallKey
				before := processors.Cursor{}
				for range len(want[tenant]) + 1 {
					page, err := s.TenantLatestByStatus(t.Context(), tenant, st, before, limit)
					if err != nil {
						t.Fatalf("TenantLatestByStatus(%s, %s, before %v, %d) = %v", tenant, st, before, limit, err)
					}
					if len(page) == 0 {
						break
					}
					paged = append(paged, keysOf(page)...)
					before = page[len(page)-1].Cursor()
				}
				w = slices.Clone(want[tenant])
				slices.Reverse(w)
				if !slices.Equal(paged, w) {
					t.Errorf("TenantLatestByStatus(%s, %s) paged by %d = %v; want %v backwards", tenant, st, limit, paged, want[tenant])
				}
			}
			if got, err := s.TenantLatestByStatus(t.Context(), tenant, st, processors.Cursor{}, 0); err != nil || len(got) != 0 {
				t.Errorf("TenantLatestByStatus(%s, %s, 0) = %v, %v; want none", tenant, st, keysOf(got), err)
			}
			if got, err := s.TenantLatestByStatus(t.Context(), "", st, processors.Cursor{}, 10); err == nil {
				t.Errorf("TenantLatestByStatus(no tenant, %s) = %v; want an error, the tenant being required", st, keysOf(got))
			}
			other := processors.Cursor{At: time.Now(), Key: of("t_other", p+"x")}
			if got, err := s.TenantLatestByStatus(t.Context(), tenant, st, other, 10); err == nil {
				t.Errorf("TenantLatestByStatus(%s, %s) from another tenant's cursor = %v; want an error", tenant, st, keysOf(got))
			}
		}
	}
}

// testByStatusFollows: a record is listed under its current status only,
// through every step that changes it, as Get returns it.
func testByStatusFollows(t *testing.T, s processors.Store) {
	k := key("follows")
	listed := func(step string, st processors.Status) {
		t.Helper()
		for _, other := range processors.Statuses {
			got := mustByStatus(t, s, other, 100)
			if other != st {
				if len(got) != 0 {
					t.Errorf("after %s: ByStatus(%q) = %v; want none", step, other, keysOf(got))
				}
				continue
			}
			want := []processors.Record{mustGet(t, s, k)}
			if diff := cmp.Diff(want, got, equateEmpty); diff != "" {
				t.Errorf("after %s: ByStatus(%q) mismatch (-want +got):\n%s", step, st, diff)
			}
		}
	}
	mustAdmit(t, s, admission(k, hashA, processors.StatusPending))
	listed("admit", processors.StatusPending)
	mustMove(t, s, move(k, processors.StatusPending, processors.StatusAuthorized))
	listed("move", processors.StatusAuthorized)
	mustMarkLogged(t, s, processors.Logged{Key: k, Seq: 3})
	listed("mark logged", processors.StatusAuthorized)
	c := mustClaim(t, s, claim(k, hashA, "executor-1", shortLease))[0].Record
	listed("claim", processors.StatusExecuting)
	waitExpired(t, s, k)
	if got := mustClaim(t, s, claim(k, hashA, "executor-2", longLease)); got[0].Outcome != processors.Reclaimed {
		t.Fatalf("Claim after lease expiry outcome = %v; want Reclaimed", got[0].Outcome)
	}
	listed("reclaim", processors.StatusExecuting)
	mustComplete(t, s, processors.Completion{Key: k, Epoch: c.Epoch + 1, Status: processors.StatusFailed, Attempt: 1, Seq: 5})
	listed("complete", processors.StatusFailed)
}

// ---------------------------------------------------------------- Get, tenants, misc

func testGetNotFound(t *testing.T, s processors.Store) {
	mustAdmit(t, s, admission(key("present"), hashA, processors.StatusAuthorized))
	for _, k := range []ledger.CallKey{
		key("absent"),
		{TenantID: "t_other", IdempotencyKey: "present"},
		{TenantID: "t_acme", IdempotencyKey: "presen"},
	} {
		if _, err := s.Get(t.Context(), k); !errors.Is(err, processors.ErrNotFound) {
			t.Errorf("Get(%v) = %v; want ErrNotFound", k, err)
		}
	}
}

// testReadBack: ReadBack reads what Get does, the record as the last
// write left it, and ErrNotFound for a key without one. (That it waits
// out a write in flight is the PostgreSQL store's own test: bbolt has
// none once a write has returned.)
func testReadBack(t *testing.T, s processors.Store) {
	k := key("read-back")
	mustAdmit(t, s, admission(k, hashA, processors.StatusPending))
	m := move(k, processors.StatusPending, processors.StatusAuthorized)
	if applied := mustMove(t, s, m); !applied[0] {
		t.Fatalf("Move(%v) applied = false; want true (the test's premise)", k)
	}
	got, err := s.ReadBack(t.Context(), k)
	if err != nil {
		t.Fatalf("ReadBack(%v) = %v", k, err)
	}
	if diff := cmp.Diff(mustGet(t, s, k), got); diff != "" || got.Status != m.To || got.Seq != m.Seq {
		t.Errorf("ReadBack(%v) = %s at %d, and differs from Get (-get +read back):\n%s", k, got.Status, got.Seq, diff)
	}
	for _, k := range []ledger.CallKey{key("absent"), {TenantID: "t_other", IdempotencyKey: "read-back"}} {
		if _, err := s.ReadBack(t.Context(), k); !errors.Is(err, processors.ErrNotFound) {
			t.Errorf("ReadBack(%v) = %v; want ErrNotFound", k, err)
		}
	}
}

func testTenantIsolation(t *testing.T, s processors.Store) {
	ka := ledger.CallKey{TenantID: "t_a", IdempotencyKey: "run_1:step_1:refund_order"}
	kb := ledger.CallKey{TenantID: "t_b", IdempotencyKey: "run_1:step_1:refund_order"}
	aa := admission(ka, hashA, processors.StatusAuthorized)
	ab := admission(kb, hashB, processors.StatusAuthorized)
	ab.Arguments = []byte(`{"tenant":"b"}`)

	// Same idempotency key, two tenants, different hashes: two calls, no
	// conflict, even within one batch.
	got := mustAdmit(t, s, aa, ab)
	for i, g := range got {
		if g.Outcome != processors.Admitted {
			t.Errorf("Admit batch[%d] outcome = %v; want Admitted", i, g.Outcome)
		}
	}
	// A retry by tenant b is b's duplicate and shows b's record only.
	dup := mustAdmit(t, s, ab)[0]
	if dup.Outcome != processors.Duplicate || !bytes.Equal(dup.Record.Arguments, ab.Arguments) {
		t.Errorf("Admit(b retry) = %v with arguments %s; want Duplicate with b's arguments", dup.Outcome, dup.Record.Arguments)
	}

	// Tenant b cannot claim with tenant a's hash: the record is b's.
	if c := mustClaim(t, s, claim(kb, hashA, "executor-1", longLease)); c[0].Outcome != processors.Mismatch {
		t.Errorf("Claim(b with a's hash) outcome = %v; want Mismatch", c[0].Outcome)
	}
	cs := mustClaim(t, s, claim(ka, hashA, "executor-a", longLease), claim(kb, hashB, "executor-b", longLease))
	for i, c := range cs {
		if c.Outcome != processors.Claimed || c.Record.Epoch != 1 {
			t.Errorf("Claim batch[%d] = %v epoch %d; want Claimed epoch 1 (independent records)", i, c.Outcome, c.Record.Epoch)
		}
	}
	beforeB := mustGet(t, s, kb)
	if applied := mustComplete(t, s, processors.Completion{Key: ka, Epoch: 1, Status: processors.StatusSucceeded, Attempt: 1, Result: []byte("a"), Seq: 4}); !applied[0] {
		t.Fatalf("Complete(a) applied = false; want true")
	}
	mustMarkLogged(t, s, processors.Logged{Key: ka, Seq: 4})
	checkUnchanged(t, s, kb, beforeB)

	ra := mustGet(t, s, ka)
	if ra.Status != processors.StatusSucceeded || string(ra.Result) != "a" || ra.LoggedSeq != 4 {
		t.Errorf("Get(a) = status %q result %q logged %d; want succeeded \"a\" 4", ra.Status, ra.Result, ra.LoggedSeq)
	}
	if ra.Key != ka || beforeB.Key != kb {
		t.Errorf("Get keys = %v, %v; want %v, %v", ra.Key, beforeB.Key, ka, kb)
	}
}

func testEmptyBatches(t *testing.T, s processors.Store) {
	ctx := t.Context()
	if got, err := s.Admit(ctx, nil); err != nil || len(got) != 0 {
		t.Errorf("Admit(nil) = %v, %v; want empty, nil", got, err)
	}
	if got, err := s.Claim(ctx, nil); err != nil || len(got) != 0 {
		t.Errorf("Claim(nil) = %v, %v; want empty, nil", got, err)
	}
	if got, err := s.Complete(ctx, nil); err != nil || len(got) != 0 {
		t.Errorf("Complete(nil) = %v, %v; want empty, nil", got, err)
	}
	if err := s.MarkLogged(ctx, nil); err != nil {
		t.Errorf("MarkLogged(nil) = %v; want nil", err)
	}
	if got, err := s.Release(ctx, nil); err != nil || len(got) != 0 {
		t.Errorf("Release(nil) = %v, %v; want empty, nil", got, err)
	}
	if got, err := s.Expired(ctx, 10); err != nil || len(got) != 0 {
		t.Errorf("Expired(10) on an empty store = %v, %v; want empty, nil", got, err)
	}
	if got, err := s.Unlogged(ctx, 0, processors.Cursor{}, 10); err != nil || got == nil || len(got) != 0 {
		t.Errorf("Unlogged(0, 10) on an empty store = %#v, %v; want empty, nil", got, err)
	}
	if got, err := s.Move(ctx, nil); err != nil || len(got) != 0 {
		t.Errorf("Move(nil) = %v, %v; want empty, nil", got, err)
	}
	if got, err := s.ByStatus(ctx, processors.StatusPending, 10); err != nil || len(got) != 0 {
		t.Errorf("ByStatus(pending, 10) on an empty store = %v, %v; want empty, nil", got, err)
	}
}

func testCancelledContext(t *testing.T, s processors.Store) {
	k := key("cancelled")
	ctx, cancel := context.WithCancel(t.Context())
	cancel()
	_, err := s.Admit(ctx, []processors.Admission{admission(k, hashA, processors.StatusAuthorized)})
	if err == nil {
		t.Errorf("Admit(cancelled ctx) = nil error; want an error")
	}
	// The data is fine: the caller must retry it, not set it aside.
	if errors.Is(err, processors.ErrRejected) {
		t.Errorf("Admit(cancelled ctx) = %v; want an error that does not wrap ErrRejected", err)
	}
	if _, err := s.Get(t.Context(), k); !errors.Is(err, processors.ErrNotFound) {
		t.Errorf("Get after cancelled Admit = %v; want ErrNotFound", err)
	}
	r := mustAdmit(t, s, admission(k, hashA, processors.StatusAuthorized))[0].Record
	if _, err := s.Claim(ctx, []processors.Claim{claim(k, hashA, "executor-1", longLease)}); err == nil || errors.Is(err, processors.ErrRejected) {
		t.Errorf("Claim(cancelled ctx) = %v; want an error that does not wrap ErrRejected", err)
	}
	checkUnchanged(t, s, k, r)
	if _, err := s.Unlogged(ctx, 0, processors.Cursor{}, 10); err == nil || errors.Is(err, processors.ErrRejected) {
		t.Errorf("Unlogged(cancelled ctx) = %v; want an error that does not wrap ErrRejected", err)
	}
	if _, err := s.Move(ctx, []processors.Move{move(k, processors.StatusAuthorized, processors.StatusExpired)}); err == nil || errors.Is(err, processors.ErrRejected) {
		t.Errorf("Move(cancelled ctx) = %v; want an error that does not wrap ErrRejected", err)
	}
	checkUnchanged(t, s, k, r)
	if _, err := s.ByStatus(ctx, processors.StatusAuthorized, 10); err == nil || errors.Is(err, processors.ErrRejected) {
		t.Errorf("ByStatus(cancelled ctx) = %v; want an error that does not wrap ErrRejected", err)
	}
}

// ---------------------------------------------------------------- concurrency

// testConcurrentAdmitClaim is the executor's race: many redeliveries of one
// call admitted and claimed at once. Exactly one admission creates the
// record and exactly one claim wins; the store retries its own
// serialization failures rather than surfacing them.
func testConcurrentAdmitClaim(t *testing.T, s processors.Store) {
	const n = 32
	k := key("race")
	var (
		wg      sync.WaitGroup
		mu      sync.Mutex
		admits  = map[processors.AdmitOutcome]int{}
		claims  = map[processors.ClaimOutcome]int{}
		winners []string
		errs    []error
	)
	start := make(chan struct{})
	for i := range n {
		owner := fmt.Sprintf("executor-%02d", i)
		wg.Go(func() {
			<-start
			ctx := t.Context()
			a, err := s.Admit(ctx, []processors.Admission{admission(k, hashA, processors.StatusAuthorized)})
			if err != nil {
				mu.Lock()
				errs = append(errs, fmt.Errorf("admit by %s: %w", owner, err))
				mu.Unlock()
				return
			}
			c, err := s.Claim(ctx, []processors.Claim{claim(k, hashA, owner, longLease)})
			mu.Lock()
			defer mu.Unlock()
			admits[a[0].Outcome]++
			if err != nil {
				errs = append(errs, fmt.Errorf("claim by %s: %w", owner, err))
				return
			}
			claims[c[0].Outcome]++
			if c[0].Outcome == processors.Claimed {
				winners = append(winners, owner)
			}
		})
	}
	close(start)
	wg.Wait()

	for _, err := range errs {
		t.Errorf("concurrent Admit+Claim: %v", err)
	}
	if admits[processors.Admitted] != 1 || admits[processors.Duplicate] != n-1 {
		t.Errorf("Admit outcomes = %v; want 1 Admitted and %d Duplicate", admits, n-1)
	}
	if claims[processors.Claimed] != 1 || claims[processors.Busy] != n-1 {
		t.Errorf("Claim outcomes = %v; want 1 Claimed and %d Busy", claims, n-1)
	}
	r := mustGet(t, s, k)
	if r.Epoch != 1 || len(winners) != 1 || r.LeaseOwner != winners[0] {
		t.Errorf("Get = epoch %d owner %q, winners %v; want epoch 1 owned by the single winner", r.Epoch, r.LeaseOwner, winners)
	}
}

// testConcurrentComplete: racing completions at the same epoch (a
// redelivered step finishing twice) apply exactly once.
func testConcurrentComplete(t *testing.T, s processors.Store) {
	const n = 16
	k := key("race-complete")
	c := admitClaimed(t, s, k, "executor-1", longLease)
	var (
		wg      sync.WaitGroup
		mu      sync.Mutex
		applied []int
		errs    []error
	)
	start := make(chan struct{})
	for i := range n {
		wg.Go(func() {
			<-start
			got, err := s.Complete(t.Context(), []processors.Completion{{
				Key: k, Epoch: c.Epoch, Status: processors.StatusSucceeded, Attempt: 1,
				Result: fmt.Appendf(nil, "result-%d", i), Seq: 4,
			}})
			mu.Lock()
			defer mu.Unlock()
			if err != nil {
				errs = append(errs, err)
				return
			}
			if got[0] {
				applied = append(applied, i)
			}
		})
	}
	close(start)
	wg.Wait()
	for _, err := range errs {
		t.Errorf("concurrent Complete: %v", err)
	}
	if len(applied) != 1 {
		t.Fatalf("concurrent Complete applied by %v; want exactly one", applied)
	}
	if r := mustGet(t, s, k); string(r.Result) != fmt.Sprintf("result-%d", applied[0]) {
		t.Errorf("Get.Result = %q; want the single winner's result-%d", r.Result, applied[0])
	}
}

// testConcurrentMove is the approval race: approvers (and the expiry
// timer) deciding one pending call at once. Exactly one move applies, and
// the record holds what that one wrote.
func testConcurrentMove(t *testing.T, s processors.Store) {
	const n = 16
	k := key("race-move")
	mustAdmit(t, s, admission(k, hashA, processors.StatusPending))
	var (
		wg      sync.WaitGroup
		mu      sync.Mutex
		applied []processors.Move
		errs    []error
	)
	start := make(chan struct{})
	for i := range n {
		// Half approve, half reject: the winner's decision stands.
		to := processors.StatusAuthorized
		if i%2 == 1 {
			to = processors.StatusRejected
		}
		m := processors.Move{Key: k, From: processors.StatusPending, FromSeq: 2, To: to, Seq: 3, Outbox: fmt.Appendf(nil, "decision-%d", i)}
		wg.Go(func() {
			<-start
			got, err := s.Move(t.Context(), []processors.Move{m})
			mu.Lock()
			defer mu.Unlock()
			if err != nil {
				errs = append(errs, err)
				return
			}
			if got[0] {
				applied = append(applied, m)
			}
		})
	}
	close(start)
	wg.Wait()
	for _, err := range errs {
		t.Errorf("concurrent Move: %v", err)
	}
	if len(applied) != 1 {
		t.Fatalf("concurrent Move applied %d moves; want exactly one", len(applied))
	}
	w := applied[0]
	if r := mustGet(t, s, k); r.Status != w.To || r.Seq != w.Seq || !bytes.Equal(r.Outbox, w.Outbox) {
		t.Errorf("Get = status %q seq %d outbox %q; want the single winner's %q %d %q", r.Status, r.Seq, r.Outbox, w.To, w.Seq, w.Outbox)
	}
}
