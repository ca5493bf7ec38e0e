package storetest

import (
	"errors"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"

	"github.com/toolcall-ledger/ledger/ledger"
	"github.com/toolcall-ledger/ledger/processors"
)

// credentialTests are the contract of Claim.Credential, Record.Credential
// and ClaimResult.Prior: whoever takes a call over after a lease ran out
// must learn what credential may have reached the tool under it.
func credentialTests() []contractTest {
	return []contractTest{
		{"Credential/Recorded", testCredentialRecorded},
		{"Credential/Reclaimed", testCredentialReclaimed},
		{"Credential/Kept", testCredentialKept},
		{"Credential/Released", testCredentialReleased},
		{"Credential/Lapsed", testCredentialLapsed},
		{"Credential/LapsedBound", testCredentialLapsedBound},
		{"Credential/ReleasedSent", testCredentialReleasedSent},
		{"Credential/IntraBatch", testCredentialIntraBatch},
		{"Credential/Invalid", testCredentialInvalid},
	}
}

// cred is a credential named after name, both parts set, so that a store
// that drops either fails the comparisons.
func cred(name string) processors.CallCredential {
	return processors.CallCredential{JTI: "jti-" + name, Family: "refund_order/t_acme/" + name}
}

// credClaim is claim with the credential c.
func credClaim(k ledger.CallKey, owner string, lease time.Duration, c processors.CallCredential) processors.Claim {
	cl := claim(k, hashA, owner, lease)
	cl.Credential = c
	return cl
}

// sticky is the credential a winning claim naming c leaves on a record
// that named kept: the call's jti is kept once named, the family is the
// claim's.
func sticky(kept, c processors.CallCredential) processors.CallCredential {
	if kept.JTI != "" {
		c.JTI = kept.JTI
	}
	return c
}

// checkCredential fails unless got is want, for what.
func checkCredential(t *testing.T, what string, got, want processors.CallCredential) {
	t.Helper()
	if got != want {
		t.Errorf("%s = %+v; want %+v", what, got, want)
	}
}

// testCredentialRecorded: a winning claim records its credential, which
// its result, Get and every other read return; a claim that does not win
// (Busy, Mismatch, Finished) writes none and is answered with the
// recorded one; no outcome but Reclaimed has a Prior.
func testCredentialRecorded(t *testing.T, s processors.Store) {
	k := key("cred:recorded")
	a := admission(k, hashA, processors.StatusAuthorized)
	mustAdmit(t, s, a)
	first := cred("first")
	got := mustClaim(t, s, credClaim(k, "executor-1", longLease, first))
	if got[0].Outcome != processors.Claimed {
		t.Fatalf("Claim outcome = %v; want Claimed", got[0].Outcome)
	}
	checkCredential(t, "Claimed result's Record.Credential", got[0].Record.Credential, first)
	checkCredential(t, "Claimed result's Prior", got[0].Prior, processors.CallCredential{})
	held := mustGet(t, s, k)
	checkCredential(t, "Get after Claim: Credential", held.Credential, first)
	if diff := cmp.Diff(got[0].Record, held, equateEmpty); diff != "" {
		t.Errorf("Get after Claim differs from Claim's record (-claim +get):\n%s", diff)
	}

	busy := mustClaim(t, s, credClaim(k, "executor-2", longLease, cred("busy")))
	if busy[0].Outcome != processors.Busy {
		t.Fatalf("Claim of a live lease outcome = %v; want Busy", busy[0].Outcome)
	}
	checkCredential(t, "Busy result's Record.Credential", busy[0].Record.Credential, first)
	checkCredential(t, "Busy result's Prior", busy[0].Prior, processors.CallCredential{})
	mismatch := mustClaim(t, s, processors.Claim{Key: k, ArgumentsHash: hashB, Owner: "executor-2", Lease: longLease, Credential: cred("mismatch")})
	if mismatch[0].Outcome != processors.Mismatch {
		t.Fatalf("Claim with another hash outcome = %v; want Mismatch", mismatch[0].Outcome)
	}
	checkCredential(t, "Mismatch result's Record.Credential", mismatch[0].Record.Credential, first)
	checkUnchanged(t, s, k, held)
	if dup := mustAdmit(t, s, a); dup[0].Outcome != processors.Duplicate {
		t.Errorf("Admit again outcome = %v; want Duplicate", dup[0].Outcome)
	} else {
		checkCredential(t, "Duplicate admission's Record.Credential", dup[0].Record.Credential, first)
	}

	mustComplete(t, s, processors.Completion{Key: k, Epoch: held.Epoch, Status: processors.StatusSucceeded, Attempt: 1, Seq: 4, Outbox: []byte("x")})
	fin := mustClaim(t, s, credClaim(k, "executor-2", longLease, cred("finished")))
	if fin[0].Outcome != processors.Finished {
		t.Fatalf("Claim of a done call outcome = %v; want Finished", fin[0].Outcome)
	}
	checkCredential(t, "Finished result's Record.Credential", fin[0].Record.Credential, first)
	checkCredential(t, "Finished result's Prior", fin[0].Prior, processors.CallCredential{})
}

// testCredentialReclaimed: a claim of a call whose owner's lease ran out
// is told the credential that owner recorded (Prior), and records its
// family, the call keeping its jti; Expired lists the call with the
// lapsed one. A reclaim that names none clears the family, not the jti.
func testCredentialReclaimed(t *testing.T, s processors.Store) {
	k := key("cred:reclaimed")
	mustAdmit(t, s, admission(k, hashA, processors.StatusAuthorized))
	first, second := cred("first"), cred("second")
	mustClaim(t, s, credClaim(k, "executor-1", shortLease, first))
	exp := waitExpired(t, s, k)
	checkCredential(t, "Expired record's Credential", exp.Credential, first)

	got := mustClaim(t, s, credClaim(k, "executor-2", shortLease, second))
	if got[0].Outcome != processors.Reclaimed {
		t.Fatalf("Claim after lease expiry outcome = %v; want Reclaimed", got[0].Outcome)
	}
	checkCredential(t, "Reclaimed result's Prior", got[0].Prior, first)
	kept := sticky(first, second)
	checkCredential(t, "Reclaimed result's Record.Credential", got[0].Record.Credential, kept)
	checkCredential(t, "Get after the reclaim: Credential", mustGet(t, s, k).Credential, kept)

	waitExpired(t, s, k)
	got = mustClaim(t, s, credClaim(k, "executor-3", shortLease, processors.CallCredential{}))
	if got[0].Outcome != processors.Reclaimed {
		t.Fatalf("second Claim after lease expiry outcome = %v; want Reclaimed", got[0].Outcome)
	}
	checkCredential(t, "second Reclaimed result's Prior", got[0].Prior, kept)
	jtiOnly := processors.CallCredential{JTI: first.JTI}
	checkCredential(t, "Record.Credential of a reclaim that names none", got[0].Record.Credential, jtiOnly)
	checkCredential(t, "Get after a reclaim that names none: Credential", mustGet(t, s, k).Credential, jtiOnly)

	waitExpired(t, s, k)
	got = mustClaim(t, s, credClaim(k, "executor-4", longLease, first))
	if got[0].Outcome != processors.Reclaimed {
		t.Fatalf("third Claim after lease expiry outcome = %v; want Reclaimed", got[0].Outcome)
	}
	checkCredential(t, "Prior after a claim that named none", got[0].Prior, jtiOnly)
	checkCredential(t, "third Reclaimed result's Record.Credential", got[0].Record.Credential, first)

	// A record that names no jti yet (its claims named none) takes the
	// first one named.
	k = key("cred:reclaimed-late")
	mustAdmit(t, s, admission(k, hashA, processors.StatusAuthorized))
	mustClaim(t, s, credClaim(k, "executor-1", shortLease, processors.CallCredential{}))
	waitExpired(t, s, k)
	got = mustClaim(t, s, credClaim(k, "executor-2", longLease, second))
	checkCredential(t, "Prior of a claim that named none", got[0].Prior, processors.CallCredential{})
	checkCredential(t, "Record.Credential of the first claim to name one", got[0].Record.Credential, second)
}

// testCredentialKept: no write but a winning claim changes the recorded
// credential (Complete, MarkLogged, Move, Settle either way), and the
// listings return it.
func testCredentialKept(t *testing.T, s processors.Store) {
	t.Run("complete, mark logged, move", func(t *testing.T) {
		k := key("cred:kept")
		c := cred("kept")
		mustAdmit(t, s, admission(k, hashA, processors.StatusAuthorized))
		r := mustClaim(t, s, credClaim(k, "executor-1", longLease, c))[0].Record
		// Unlogged and ByStatus list it: outcome_unknown is listed, and
		// no journal leaves it unlogged.
		if applied := mustComplete(t, s, processors.Completion{Key: k, Epoch: r.Epoch, Status: processors.StatusOutcomeUnknown, Attempt: 1, Seq: 4, Outbox: []byte(`[{"seq":3},{"seq":4}]`)}); !applied[0] {
			t.Fatalf("Complete applied = false; want true")
		}
		checkCredential(t, "Get after Complete: Credential", mustGet(t, s, k).Credential, c)
		listed := waitUnlogged(t, s, []ledger.CallKey{k})
		checkCredential(t, "Unlogged record's Credential", listed[0].Credential, c)
		byStatus := mustByStatus(t, s, processors.StatusOutcomeUnknown, 10)
		if len(byStatus) != 1 {
			t.Fatalf("ByStatus(outcome_unknown) = %v; want %v", keysOf(byStatus), k)
		}
		checkCredential(t, "ByStatus record's Credential", byStatus[0].Credential, c)
		tenant, err := s.TenantByStatus(t.Context(), k.TenantID, processors.StatusOutcomeUnknown, 10)
		if err != nil || len(tenant) != 1 {
			t.Fatalf("TenantByStatus(outcome_unknown) = %v, %v; want %v", keysOf(tenant), err, k)
		}
		checkCredential(t, "TenantByStatus record's Credential", tenant[0].Credential, c)

		mustMarkLogged(t, s, processors.Logged{Key: k, Seq: 4})
		checkCredential(t, "Get after MarkLogged: Credential", mustGet(t, s, k).Credential, c)
		m := processors.Move{Key: k, From: processors.StatusOutcomeUnknown, FromSeq: 4, To: processors.StatusSucceeded, Seq: 5, Outbox: []byte(`[{"seq":5}]`)}
		if applied := mustMove(t, s, m); !applied[0] {
			t.Fatalf("Move(outcome_unknown -> succeeded) applied = false; want true")
		}
		checkCredential(t, "Get after Move: Credential", mustGet(t, s, k).Credential, c)
	})
	t.Run("settle", func(t *testing.T) {
		for _, logged := range []bool{true, false} {
			k := key(fmt.Sprintf("cred:settle-%v", logged))
			c := cred(fmt.Sprintf("settle-%v", logged))
			journal := fmt.Sprintf("cred-step-%v", logged)
			mustAdmit(t, s, admission(k, hashA, processors.StatusAuthorized))
			mustMarkLogged(t, s, processors.Logged{Key: k, Seq: 2})
			r := mustClaim(t, s, credClaim(k, "executor-1", longLease, c))[0].Record
			if applied := mustComplete(t, s, journaledCompletion(k, r.Epoch, journal)); !applied[0] {
				t.Fatalf("Complete(journal %q) applied = false; want true", journal)
			}
			mustSettle(t, s, logged, journal)
			got := mustGet(t, s, k)
			checkCredential(t, fmt.Sprintf("Get after Settle(logged %v): Credential", logged), got.Credential, c)
			if !logged && got.LoggedSeq != 2 {
				t.Errorf("Get after Settle(not logged): LoggedSeq %d; want 2 (the settle applied)", got.LoggedSeq)
			}
		}
	})
}

// testCredentialReleased: a release keeps the credential of the claim it
// gives back; the claim that takes the call once the release ended is
// Claimed with no Prior (nothing was sent under the released claim), and
// records its family, the call keeping its jti.
func testCredentialReleased(t *testing.T, s processors.Store) {
	k := key("cred:released")
	first, second := cred("released"), cred("after-release")
	mustAdmit(t, s, admission(k, hashA, processors.StatusAuthorized))
	r := mustClaim(t, s, credClaim(k, "executor-1", longLease, first))[0].Record
	if applied := mustRelease(t, s, processors.Release{Key: k, Epoch: r.Epoch, After: shortLease}); !applied[0] {
		t.Fatalf("Release applied = false; want true")
	}
	checkCredential(t, "Get after Release: Credential", mustGet(t, s, k).Credential, first)
	exp := waitExpired(t, s, k)
	checkCredential(t, "Expired record's Credential after a release", exp.Credential, first)

	got := mustClaim(t, s, credClaim(k, "executor-2", longLease, second))
	if got[0].Outcome != processors.Claimed {
		t.Fatalf("Claim after the release ended outcome = %v; want Claimed", got[0].Outcome)
	}
	checkCredential(t, "Prior of a claim after a release", got[0].Prior, processors.CallCredential{})
	checkCredential(t, "Record.Credential of a claim after a release", got[0].Record.Credential, sticky(first, second))
	checkCredential(t, "Get after the claim: Credential", mustGet(t, s, k).Credential, sticky(first, second))
}

// checkLapsed fails unless got is want, for what.
func checkLapsed(t *testing.T, what string, got, want []string) {
	t.Helper()
	if !slices.Equal(got, want) {
		t.Errorf("%s LapsedFamilies = %q; want %q", what, got, want)
	}
}

// reclaim claims k for owner, under a credential c, once the lease on it
// ran out, and returns the result, Reclaimed.
func reclaim(t *testing.T, s processors.Store, k ledger.CallKey, owner string, lease time.Duration, c processors.CallCredential) processors.ClaimResult {
	t.Helper()
	var got processors.ClaimResult
	waitFor(t, pollTimeout, func() error {
		got = mustClaim(t, s, credClaim(k, owner, lease, c))[0]
		if got.Outcome != processors.Reclaimed {
			return fmt.Errorf("Claim by %s outcome = %v; want Reclaimed", owner, got.Outcome)
		}
		return nil
	})
	return got
}

// testCredentialLapsed: each claim that takes a call over adds the
// family the expired claim named to Record.LapsedFamilies, in the order
// they lapsed, once each, none for a claim that named none; so when one
// owner dies after another, neither family is lost. Every read returns
// them; a release, a completion and a fresh claim add none.
func testCredentialLapsed(t *testing.T, s processors.Store) {
	k := key("cred:lapsed")
	mustAdmit(t, s, admission(k, hashA, processors.StatusAuthorized))
	first, second := cred("lapsed-1"), cred("lapsed-2")
	got := mustClaim(t, s, credClaim(k, "executor-1", shortLease, first))[0]
	checkLapsed(t, "Claimed result's Record", got.Record.LapsedFamilies, nil)

	got = reclaim(t, s, k, "executor-2", shortLease, second)
	checkLapsed(t, "first Reclaimed result's Record", got.Record.LapsedFamilies, []string{first.Family})
	checkCredential(t, "first Reclaimed result's Prior", got.Prior, first)
	checkLapsed(t, "Expired record", waitExpired(t, s, k).LapsedFamilies, []string{first.Family})

	// The second owner died too: its family is added after the first's.
	got = reclaim(t, s, k, "executor-3", shortLease, processors.CallCredential{})
	both := []string{first.Family, second.Family}
	checkLapsed(t, "second Reclaimed result's Record", got.Record.LapsedFamilies, both)
	checkCredential(t, "second Reclaimed result's Prior", got.Prior, sticky(first, second))
	checkLapsed(t, "Get after the second reclaim", mustGet(t, s, k).LapsedFamilies, both)

	// The third named none: nothing to add. The fourth's family is the
	// first's, there already.
	got = reclaim(t, s, k, "executor-4", shortLease, first)
	checkLapsed(t, "Reclaimed result's Record after a claim that named none", got.Record.LapsedFamilies, both)
	got = reclaim(t, s, k, "executor-5", longLease, second)
	checkLapsed(t, "Reclaimed result's Record after a family lapsed again", got.Record.LapsedFamilies, both)
	if busy := mustClaim(t, s, credClaim(k, "executor-6", longLease, cred("busy")))[0]; busy.Outcome != processors.Busy {
		t.Fatalf("Claim of a live lease outcome = %v; want Busy", busy.Outcome)
	} else {
		checkLapsed(t, "Busy result's Record", busy.Record.LapsedFamilies, both)
	}
	if applied := mustComplete(t, s, processors.Completion{Key: k, Epoch: got.Record.Epoch, Status: processors.StatusOutcomeUnknown, Attempt: 1, Seq: 4, Outbox: []byte(`[{"seq":3},{"seq":4}]`)}); !applied[0] {
		t.Fatalf("Complete applied = false; want true")
	}
	checkLapsed(t, "Get after Complete", mustGet(t, s, k).LapsedFamilies, both)
	if byStatus := mustByStatus(t, s, processors.StatusOutcomeUnknown, 10); len(byStatus) != 1 || byStatus[0].Key != k {
		t.Fatalf("ByStatus(outcome_unknown) = %v; want %v", keysOf(byStatus), k)
	} else {
		checkLapsed(t, "ByStatus record", byStatus[0].LapsedFamilies, both)
	}

	// A claim given back sent nothing: the claim after it adds nothing.
	k = key("cred:lapsed-released")
	mustAdmit(t, s, admission(k, hashA, processors.StatusAuthorized))
	r := mustClaim(t, s, credClaim(k, "executor-1", longLease, first))[0].Record
	if applied := mustRelease(t, s, processors.Release{Key: k, Epoch: r.Epoch, After: shortLease}); !applied[0] {
		t.Fatalf("Release applied = false; want true")
	}
	waitExpired(t, s, k)
	if got := mustClaim(t, s, credClaim(k, "executor-2", longLease, second))[0]; got.Outcome != processors.Claimed {
		t.Fatalf("Claim after the release ended outcome = %v; want Claimed", got.Outcome)
	} else {
		checkLapsed(t, "Record of a claim after a release", got.Record.LapsedFamilies, nil)
	}
}

// testCredentialLapsedBound: a call whose owners kept dying keeps the
// first processors.MaxLapsedFamilies families, in order.
func testCredentialLapsedBound(t *testing.T, s processors.Store) {
	k := key("cred:lapsed-bound")
	mustAdmit(t, s, admission(k, hashA, processors.StatusAuthorized))
	const lease = time.Millisecond
	mustClaim(t, s, credClaim(k, "executor-0", lease, cred("bound-0")))
	var want []string
	for i := 1; i <= processors.MaxLapsedFamilies+2; i++ {
		if len(want) < processors.MaxLapsedFamilies {
			want = append(want, cred(fmt.Sprintf("bound-%d", i-1)).Family)
		}
		got := reclaim(t, s, k, fmt.Sprintf("executor-%d", i), lease, cred(fmt.Sprintf("bound-%d", i)))
		checkLapsed(t, fmt.Sprintf("Record after reclaim %d", i), got.Record.LapsedFamilies, want)
		if t.Failed() {
			return
		}
	}
	checkLapsed(t, "Get after the reclaims", mustGet(t, s, k).LapsedFamilies, want)
}

// testCredentialReleasedSent: a release that names the family its
// claim's requests reached the tool under (Release.Sent) adds it to
// Record.LapsedFamilies, once, after the families lapsed before it, up
// to processors.MaxLapsedFamilies, and raises the record's attempt to its
// own (Release.Attempt), never lowering it; one fenced out changes
// neither. The claim after it is Claimed (the tool answered those
// requests without effect), and its record keeps them.
func testCredentialReleasedSent(t *testing.T, s processors.Store) {
	k := key("cred:released-sent")
	mustAdmit(t, s, admission(k, hashA, processors.StatusAuthorized))
	first, second := cred("sent-1"), cred("sent-2")
	attempt := 0
	release := func(c processors.CallCredential, sent string) processors.Record {
		t.Helper()
		var r processors.Record
		waitFor(t, pollTimeout, func() error {
			got := mustClaim(t, s, credClaim(k, "executor-1", longLease, c))[0]
			if got.Outcome != processors.Claimed {
				return fmt.Errorf("Claim after a release outcome = %v; want Claimed", got.Outcome)
			}
			r = got.Record
			return nil
		})
		if applied := mustRelease(t, s, processors.Release{Key: k, Epoch: r.Epoch, After: time.Millisecond, Sent: sent, Attempt: attempt}); !applied[0] {
			t.Fatalf("Release(sent %q) applied = false; want true", sent)
		}
		return r
	}
	checkAttempt := func(what string, want int) {
		t.Helper()
		if got := mustGet(t, s, k).Attempt; got != want {
			t.Errorf("%s: Attempt = %d; want %d", what, got, want)
		}
	}
	attempt = 2
	release(first, first.Family)
	checkLapsed(t, "Get after a release that sent", mustGet(t, s, k).LapsedFamilies, []string{first.Family})
	checkAttempt("Get after a release of attempt 2", 2)
	// The same family again, then none: nothing added. Lower attempts
	// lower nothing.
	attempt = 1
	release(first, first.Family)
	checkAttempt("Get after a release of attempt 1", 2)
	attempt = 0
	r := release(first, "")
	checkAttempt("Get after a release of no attempt", 2)
	checkLapsed(t, "Claimed record after releases", r.LapsedFamilies, []string{first.Family})
	checkLapsed(t, "Get after a release that sent nothing", mustGet(t, s, k).LapsedFamilies, []string{first.Family})
	// A release of an epoch no longer current adds nothing.
	if applied := mustRelease(t, s, processors.Release{Key: k, Epoch: r.Epoch - 1, Sent: "stale/family", Attempt: 9}); applied[0] {
		t.Fatalf("Release of a stale epoch applied = true; want false")
	}
	checkAttempt("Get after a stale release", 2)
	release(second, second.Family)
	both := []string{first.Family, second.Family}
	checkLapsed(t, "Get after a second family sent", mustGet(t, s, k).LapsedFamilies, both)
	checkLapsed(t, "Expired record", waitExpired(t, s, k).LapsedFamilies, both)
	checkLapsed(t, "Claimed record after the second", release(cred("sent-3"), "").LapsedFamilies, both)

	// Bounded as a takeover's.
	want := both
	for i := 3; i <= processors.MaxLapsedFamilies+2; i++ {
		c := cred(fmt.Sprintf("sent-%d", i))
		release(c, c.Family)
		if len(want) < processors.MaxLapsedFamilies {
			want = append(want, c.Family)
		}
	}
	checkLapsed(t, "Get after the bound", mustGet(t, s, k).LapsedFamilies, want)
}

// testCredentialIntraBatch: of several claims of one key in a batch, the
// one that wins records its credential; the later ones are Busy, with the
// winner's credential in their record and no Prior.
func testCredentialIntraBatch(t *testing.T, s processors.Store) {
	t.Run("claimed", func(t *testing.T) {
		k := key("cred:intra-claimed")
		mustAdmit(t, s, admission(k, hashA, processors.StatusAuthorized))
		first, second := cred("intra-1"), cred("intra-2")
		got := mustClaim(t, s, credClaim(k, "executor-1", longLease, first), credClaim(k, "executor-2", longLease, second))
		if got[0].Outcome != processors.Claimed || got[1].Outcome != processors.Busy {
			t.Fatalf("Claim batch outcomes = %v, %v; want Claimed, Busy", got[0].Outcome, got[1].Outcome)
		}
		checkCredential(t, "batch[0] Record.Credential", got[0].Record.Credential, first)
		checkCredential(t, "batch[1] (Busy) Record.Credential", got[1].Record.Credential, first)
		checkCredential(t, "batch[1] (Busy) Prior", got[1].Prior, processors.CallCredential{})
		checkCredential(t, "Get after the batch: Credential", mustGet(t, s, k).Credential, first)
	})
	t.Run("reclaimed", func(t *testing.T) {
		k := key("cred:intra-reclaimed")
		mustAdmit(t, s, admission(k, hashA, processors.StatusAuthorized))
		lapsed, second, third := cred("lapsed"), cred("intra-2"), cred("intra-3")
		mustClaim(t, s, credClaim(k, "executor-1", shortLease, lapsed))
		waitExpired(t, s, k)
		got := mustClaim(t, s, credClaim(k, "executor-2", longLease, second), credClaim(k, "executor-3", longLease, third))
		if got[0].Outcome != processors.Reclaimed || got[1].Outcome != processors.Busy {
			t.Fatalf("Claim batch outcomes = %v, %v; want Reclaimed, Busy", got[0].Outcome, got[1].Outcome)
		}
		checkCredential(t, "batch[0] (Reclaimed) Prior", got[0].Prior, lapsed)
		won := sticky(lapsed, second)
		checkCredential(t, "batch[0] (Reclaimed) Record.Credential", got[0].Record.Credential, won)
		checkCredential(t, "batch[1] (Busy) Record.Credential", got[1].Record.Credential, won)
		checkCredential(t, "batch[1] (Busy) Prior", got[1].Prior, processors.CallCredential{})
		checkCredential(t, "Get after the batch: Credential", mustGet(t, s, k).Credential, won)
	})
}

// testCredentialInvalid: a jti or family longer than a store must hold is
// rejected (ErrRejected) before anything is written, the batch's other
// claims included; one at the bound is recorded intact.
func testCredentialInvalid(t *testing.T, s processors.Store) {
	const bound = 512 // processors.CheckClaims's
	k, other := key("cred:invalid"), key("cred:invalid-other")
	mustAdmit(t, s, admission(k, hashA, processors.StatusAuthorized), admission(other, hashA, processors.StatusAuthorized))
	before, otherBefore := mustGet(t, s, k), mustGet(t, s, other)
	long := strings.Repeat("j", bound+1)
	for _, tc := range []struct {
		name string
		c    processors.CallCredential
	}{
		{"jti too long", processors.CallCredential{JTI: long, Family: "f"}},
		{"family too long", processors.CallCredential{JTI: "j", Family: long}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cs := []processors.Claim{credClaim(other, "executor-1", longLease, cred("ok")), credClaim(k, "executor-1", longLease, tc.c)}
			if _, err := s.Claim(t.Context(), cs); !errors.Is(err, processors.ErrRejected) {
				t.Errorf("Claim(%s) = %v; want an error wrapping ErrRejected", tc.name, err)
			}
			checkUnchanged(t, s, k, before)
			checkUnchanged(t, s, other, otherBefore)
		})
	}
	t.Run("at the bound", func(t *testing.T) {
		c := processors.CallCredential{JTI: strings.Repeat("j", bound), Family: strings.Repeat("f", bound)}
		got := mustClaim(t, s, credClaim(k, "executor-1", longLease, c))
		if got[0].Outcome != processors.Claimed {
			t.Fatalf("Claim with a credential at the bound outcome = %v; want Claimed", got[0].Outcome)
		}
		if r := mustGet(t, s, k); r.Credential != c {
			t.Errorf("Get after a claim at the bound: jti of %d bytes, family of %d; want both %d bytes, intact", len(r.Credential.JTI), len(r.Credential.Family), bound)
		}
	})
}
