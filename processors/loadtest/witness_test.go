package loadtest

import (
	"net/http/httptest"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"

	"github.com/toolcall-ledger/ledger/processors/demobackend"
	"github.com/toolcall-ledger/ledger/processors/httptool"
	"github.com/toolcall-ledger/ledger/statemachine"
)

// witRunID is the run the hand-built results and effects belong to.
const witRunID = "bwit"

// witResult returns run runID's result as Run builds it: every call in
// finished reached its terminal event, those in succeeded a succeeded one
// (the rest failed).
func witResult(t *testing.T, runID string, succeeded []int64, failed ...int64) Result {
	t.Helper()
	r := &run{
		cfg:     Config{RunID: runID},
		waiting: make(map[int64]inflight),
		drained: make(chan struct{}),
		res:     Result{ByState: make(map[string]int64), RunID: runID, e2e: NewHistogram(), added: NewHistogram()},
	}
	start := time.Now()
	for _, i := range append(append([]int64(nil), succeeded...), failed...) {
		r.waiting[i] = inflight{start: start}
	}
	for _, i := range succeeded {
		r.finish(i, statemachine.EventSucceeded, start.Add(time.Millisecond), time.Time{}, 0)
	}
	for _, i := range failed {
		r.finish(i, statemachine.EventFailed, start.Add(time.Millisecond), time.Time{}, 0)
	}
	return r.res
}

// witKey is call i's key as the ledger sends it downstream (and as the
// backend records it): "<tenant>/<idempotency key>".
func witKey(runID string, i int64) string { return tenantName(int(i%3)) + "/" + callKey(runID, i) }

// witEffect is a new side effect of call i of runID.
func witEffect(runID string, i int64) demobackend.Effect {
	return demobackend.Effect{Tool: "create_ticket", IdempotencyKey: witKey(runID, i), TenantID: tenantName(int(i % 3))}
}

// witRead is a read of call i of runID.
func witRead(runID string, i int64) demobackend.Effect {
	return demobackend.Effect{Tool: "get_weather", IdempotencyKey: witKey(runID, i), TenantID: tenantName(int(i % 3)), Read: true}
}

// attempt is ef as the request of attempt n.
func attempt(ef demobackend.Effect, n int) demobackend.Effect {
	ef.Attempt = n
	return ef
}

// withJTI is ef as sent with the credential jti.
// issuedLater is ef with its credential issued a lease later, as a
// takeover's claim mints it.
func issuedLater(ef demobackend.Effect) demobackend.Effect {
	ef.CredentialIssued = ef.CredentialIssued.Add(30 * time.Second)
	return ef
}

func withJTI(ef demobackend.Effect, jti string) demobackend.Effect {
	ef.JTI = jti
	return ef
}

// witReplay is a native replay of call i of runID: no new effect.
func witReplay(runID string, i int64) demobackend.Effect {
	ef := witEffect(runID, i)
	ef.Replay = true
	return ef
}

func TestCheck(t *testing.T) {
	cases := []struct {
		name      string
		succeeded []int64
		failed    []int64
		effects   []demobackend.Effect
		want      Witness
	}{
		{
			name:      "one effect per succeeded call",
			succeeded: []int64{0, 1, 2},
			effects:   []demobackend.Effect{witEffect(witRunID, 0), witRead(witRunID, 1), witEffect(witRunID, 2)},
			want:      Witness{Effects: 2, Reads: 1},
		},
		{
			name:      "two new effects under one key",
			succeeded: []int64{0, 1},
			effects:   []demobackend.Effect{witEffect(witRunID, 0), witEffect(witRunID, 1), witEffect(witRunID, 1)},
			want:      Witness{Effects: 3, Duplicates: 1},
		},
		{
			name:      "three new effects under one key are one duplicated call",
			succeeded: []int64{5},
			effects:   []demobackend.Effect{witEffect(witRunID, 5), witEffect(witRunID, 5), witEffect(witRunID, 5)},
			want:      Witness{Effects: 3, Duplicates: 1},
		},
		{
			name:      "succeeded without an effect",
			succeeded: []int64{0, 1},
			effects:   []demobackend.Effect{witEffect(witRunID, 0)},
			want:      Witness{Effects: 1, Missing: 1},
		},
		{
			name:      "effect of a call not reported succeeded",
			succeeded: []int64{0},
			effects:   []demobackend.Effect{witEffect(witRunID, 0), witEffect(witRunID, 1)},
			want:      Witness{Effects: 2, Orphans: 1},
		},
		{
			name:      "effect of a call that failed",
			succeeded: []int64{0},
			failed:    []int64{1},
			effects:   []demobackend.Effect{witEffect(witRunID, 0), witEffect(witRunID, 1)},
			want:      Witness{Effects: 2, Orphans: 1},
		},
		{
			name:      "a read of a call not reported succeeded is an orphan too",
			succeeded: nil,
			effects:   []demobackend.Effect{witRead(witRunID, 7)},
			want:      Witness{Reads: 1, Orphans: 1},
		},
		{
			name:      "replays are not duplicates",
			succeeded: []int64{0},
			effects:   []demobackend.Effect{witEffect(witRunID, 0), witReplay(witRunID, 0), witReplay(witRunID, 0)},
			want:      Witness{Effects: 1, Replays: 2},
		},
		// A retry is an attempt of a higher number; the same attempt
		// twice is the ledger sending it twice, which the tool's own
		// dedupe absorbed.
		{
			name:      "replays of later attempts are retries",
			succeeded: []int64{0},
			effects:   []demobackend.Effect{attempt(witEffect(witRunID, 0), 1), attempt(witReplay(witRunID, 0), 2), attempt(witReplay(witRunID, 0), 3)},
			want:      Witness{Effects: 1, Replays: 2},
		},
		{
			name:      "an attempt sent twice",
			succeeded: []int64{0, 1},
			effects: []demobackend.Effect{attempt(witEffect(witRunID, 0), 1), attempt(witReplay(witRunID, 0), 1), attempt(witReplay(witRunID, 0), 1),
				attempt(witEffect(witRunID, 1), 1)},
			want: Witness{Effects: 2, Replays: 2, DuplicateSends: 1},
		},
		{
			// A takeover after the lease expired sends the attempt again
			// under a claim of its own: the call's jti, minted anew.
			name:      "an attempt sent again under another claim",
			succeeded: []int64{0},
			effects:   []demobackend.Effect{withJTI(attempt(witEffect(witRunID, 0), 1), "j1"), issuedLater(withJTI(attempt(witReplay(witRunID, 0), 1), "j1"))},
			want:      Witness{Effects: 1, Replays: 1},
		},
		{
			name:      "an attempt sent twice under one claim",
			succeeded: []int64{0},
			effects:   []demobackend.Effect{withJTI(attempt(witEffect(witRunID, 0), 1), "j1"), withJTI(attempt(witReplay(witRunID, 0), 1), "j1"), withJTI(attempt(witReplay(witRunID, 0), 1), "j1")},
			want:      Witness{Effects: 1, Replays: 2, DuplicateSends: 1},
		},
		{
			name:      "a read's attempt sent twice is no effect",
			succeeded: []int64{0},
			effects:   []demobackend.Effect{attempt(witRead(witRunID, 0), 1), attempt(witRead(witRunID, 0), 1)},
			want:      Witness{Reads: 2},
		},
		{
			name:      "a replay alone is the call seen",
			succeeded: []int64{0},
			effects:   []demobackend.Effect{witReplay(witRunID, 0)},
			want:      Witness{Replays: 1},
		},
		{
			name:      "repeated reads are not duplicates",
			succeeded: []int64{3},
			effects:   []demobackend.Effect{witRead(witRunID, 3), witRead(witRunID, 3), witRead(witRunID, 3)},
			want:      Witness{Reads: 3},
		},
		{
			name:      "effects of another run are ignored",
			succeeded: []int64{0},
			effects: []demobackend.Effect{
				witEffect("bother", 0), witEffect("bother", 0), witEffect("bother", 1),
				witEffect("bwi", 0), witEffect("bwitx", 0), witEffect("xbwit", 0),
			},
			want: Witness{Missing: 1},
		},
		{
			name:      "keys without the tenant are not the ledger's",
			succeeded: []int64{0},
			effects: []demobackend.Effect{
				{Tool: "create_ticket", IdempotencyKey: callKey(witRunID, 0)},
				{Tool: "create_ticket", IdempotencyKey: "/" + witRunID + "-0"},
			},
			want: Witness{Missing: 1},
		},
		{
			name:      "malformed keys of the run are ignored",
			succeeded: []int64{0},
			effects: []demobackend.Effect{
				witEffect(witRunID, 0),
				{Tool: "create_ticket", IdempotencyKey: "t_bench0/00000000:" + witRunID + "-"},
				{Tool: "create_ticket", IdempotencyKey: "t_bench0/00000000:" + witRunID + "-x"},
				{Tool: "create_ticket", IdempotencyKey: "t_bench0/00000000:" + witRunID + "--3"},
			},
			want: Witness{Effects: 1},
		},
		{
			name:      "calls across bitmap words",
			succeeded: []int64{0, 63, 64, 127, 128, 1000},
			effects: []demobackend.Effect{
				witEffect(witRunID, 0), witEffect(witRunID, 63), witEffect(witRunID, 64),
				witRead(witRunID, 127), witEffect(witRunID, 128), witEffect(witRunID, 1000),
				witEffect(witRunID, 999), // succeeded's neighbour, not succeeded
			},
			want: Witness{Effects: 6, Reads: 1, Orphans: 1},
		},
		{
			name:      "every failure at once",
			succeeded: []int64{0, 1, 2},
			effects: []demobackend.Effect{
				witEffect(witRunID, 0), witEffect(witRunID, 0), // duplicate
				witRead(witRunID, 1), // fine
				// 2 missing
				witEffect(witRunID, 3), // orphan
				witEffect("bother", 2), // another run's
			},
			want: Witness{Effects: 3, Reads: 1, Duplicates: 1, Missing: 1, Orphans: 1},
		},
		{
			name: "nothing at all",
			want: Witness{},
		},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			res := witResult(t, witRunID, tc.succeeded, tc.failed...)
			if diff := cmp.Diff(tc.want, Check(res, tc.effects)); diff != "" {
				t.Errorf("Check (-want +got):\n%s", diff)
			}
		})
	}
}

// TestCheckFromBackend runs the check over what the demo backend itself
// records: a repeated create_ticket under one key is a native replay, a
// repeated get_weather a read, neither a duplicate effect; a create_ticket
// under the same idempotency key for another tenant is a new effect of
// that call, so a duplicate. Each request here is attempt 1: the replay,
// and the other tenant's request, are attempts sent twice.
func TestCheckFromBackend(t *testing.T) {
	backend := demobackend.New(demobackend.Config{})
	t.Cleanup(func() { backend.Close() })
	// The effects come from the backend's own witness; it is fed through
	// its HTTP handler as the executor would.
	srv := witServe(t, backend)
	for _, c := range []struct {
		tool, tenant string
		i            int64
		args         string
	}{
		{"create_ticket", tenantName(0), 0, `{"title":"a"}`},
		{"create_ticket", tenantName(0), 0, `{"title":"a"}`}, // replay
		{"get_weather", tenantName(1), 1, `{"city":"Oslo"}`},
		{"get_weather", tenantName(1), 1, `{"city":"Oslo"}`}, // another read
		{"create_ticket", tenantName(2), 2, `{"title":"c"}`},
		{"create_ticket", tenantName(0), 2, `{"title":"c"}`}, // same key, other tenant: a second effect
	} {
		witPost(t, srv, c.tool, c.tenant, witKeyFor(c.tenant, witRunID, c.i), c.args)
	}
	res := witResult(t, witRunID, []int64{0, 1, 2})
	want := Witness{Effects: 3, Reads: 2, Replays: 1, Duplicates: 1, DuplicateSends: 2}
	if diff := cmp.Diff(want, Check(res, backend.Effects())); diff != "" {
		t.Errorf("Check (-want +got):\n%s", diff)
	}
}

// witServe serves backend over HTTP until the test ends.
func witServe(t *testing.T, backend *demobackend.Server) string {
	t.Helper()
	srv := httptest.NewServer(backend.Handler())
	t.Cleanup(srv.Close)
	return srv.URL
}

// witPost calls tool at the backend as the executor does.
func witPost(t *testing.T, base, tool, tenant, key, args string) {
	t.Helper()
	_, err := httptool.New(httptool.Config{}).Call(t.Context(), httptool.Request{
		URL: base + "/tools/" + tool, IdempotencyKey: key, TenantID: tenant,
		CallID: "call_" + key, Attempt: 1, Arguments: []byte(args),
	})
	if err != nil {
		t.Fatalf("%s %s for %s: %v", tool, key, tenant, err)
	}
}

// witKeyFor is call i's downstream key for tenant.
func witKeyFor(tenant, runID string, i int64) string { return tenant + "/" + callKey(runID, i) }

func TestResultSucceeded(t *testing.T) {
	res := witResult(t, witRunID, []int64{0, 63, 64, 200}, 1, 65)
	for i := int64(-2); i < 300; i++ {
		want := i == 0 || i == 63 || i == 64 || i == 200
		if got := res.Succeeded(i); got != want {
			t.Errorf("Succeeded(%d) = %v; want %v", i, got, want)
		}
	}
	if diff := cmp.Diff(map[string]int64{"succeeded": 4, "failed": 2}, res.ByState); diff != "" {
		t.Errorf("ByState (-want +got):\n%s", diff)
	}
	if got := (Result{}).Succeeded(0); got {
		t.Errorf("zero Result: Succeeded(0) = true")
	}
}
