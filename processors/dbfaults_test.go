package processors_test

// Database faults on the execution store path: the intake and the
// executor run real load on the SQL store (PostgreSQL standing in for
// CockroachDB) through a TCP fault proxy (storetest.Proxy) that cuts
// connections, slows every round trip, or lets a COMMIT through and cuts
// the connection before its answer; and against concurrent writers that
// force serialization failures. At the far side, every call must end
// (none lost), no effect may happen twice at the tools, and every
// succeeded call must have exactly one effect.
//
// Where CockroachDB differs: it reports a COMMIT whose outcome it does
// not know itself (a node lost mid-commit) as 40003
// (statement_completion_unknown), and cockroach-go's ExecuteTx turns a
// failed RELEASE SAVEPOINT into an AmbiguousCommitError; neither retries
// it. pgstore returns both as errors, like the lost answers below, and
// the executor resolves them the same way. CockroachDB also restarts
// transactions (40001) on contention that PostgreSQL's SSI would not
// see, so the retry counts differ; the outcome must not.

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/toolcall-ledger/ledger/ledger"
	"github.com/toolcall-ledger/ledger/ledger/ledgertest"
	"github.com/toolcall-ledger/ledger/processors"
	"github.com/toolcall-ledger/ledger/processors/executor"
	"github.com/toolcall-ledger/ledger/processors/pgstore"
	"github.com/toolcall-ledger/ledger/processors/policy"
	"github.com/toolcall-ledger/ledger/processors/storetest"
	"github.com/toolcall-ledger/ledger/statemachine"
)

// dbPolicies allow both tools of the load (refund_order is high risk and
// has no permit in testdata/policies).
const dbPolicies = `
@id("tickets") permit (principal, action == Action::"tool::create_ticket", resource);
@id("refunds") permit (principal, action == Action::"tool::refund_order", resource);`

// Fragments of pgstore's SQL by which the proxy aims a cut at one kind of
// transaction. If pgstore's statements change, the cuts stop firing and
// the tests say so.
const (
	dbClaimSQL    = "SET status = 'executing'"
	dbCompleteSQL = "lease_owner = '', lease_until = NULL"
	dbAdmitSQL    = "ON CONFLICT (tenant_id, idempotency_key) DO NOTHING"
)

// dbRetryMsg is the Warn pgstore logs for each transaction retry.
const dbRetryMsg = "execution store transaction retry"

// dbHarness is a harness whose SQL store reaches PostgreSQL through a
// fault proxy.
type dbHarness struct {
	*harness
	proxy *storetest.Proxy
	store *dbStore
	// storeLog counts the store's log records, its retries by SQLSTATE;
	// procLog counts the processors' (step failures and the like).
	storeLog, procLog *dbCounts
	// reconciling: a reconciler runs, and dbCheck accepts calls whose
	// outcome was unknown and that it resolved by the tool's answer.
	reconciling bool
}

// startReconciler runs a reconciler on the store, as a deployment does
// next to its executors.
func (h *dbHarness) startReconciler() {
	h.t.Helper()
	h.harness.startReconciler("reconciler-db")
	h.reconciling = true
}

func newDBHarness(t *testing.T, partitions int32) *dbHarness {
	t.Helper()
	// A kind newHarness does not know opens no store: this one is
	// opened here, on the proxy.
	h := newHarness(t, storeKind("sql-through-proxy"), partitions)
	dsn := storetest.PGDSN(t)
	schema := storetest.FreshSchema(t, dsn)
	proxy, proxied := storetest.StartProxy(t, dsn)
	d := &dbHarness{harness: h, proxy: proxy, storeLog: newDBCounts(), procLog: newDBCounts()}
	st, err := pgstore.Open(t.Context(), pgstore.Config{
		DSN: proxied, Schema: schema, Logger: slog.New(dbLog{d.storeLog, h.logger.Handler()}),
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { st.Close() })
	d.store = &dbStore{Store: st, leases: make(map[dbEpoch]time.Time)}
	h.store, h.pgDSN, h.pgSchema = d.store, dsn, schema
	h.logger = slog.New(dbLog{d.procLog, h.logger.Handler()})
	// A policy evaluation is CPU only, and 2 cores under -race running
	// every test of the tree can take longer than the default 50ms,
	// which refuses the call (policy_timeout): a fault of no interest here.
	pol, err := policy.NewEngine(policy.Config{Set: loadSet(t, "db-faults", dbPolicies), Timeout: 5 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	h.policy = pol
	return d
}

// dbCalls builds n calls, create_ticket and refund_order in turn, for
// tenant t_db.
func (h *dbHarness) dbCalls(prefix string, n int) []envelope {
	h.t.Helper()
	assertion := h.ident.Assertion(h.t, "t_db", "u_1")
	envs := make([]envelope, n)
	for i := range envs {
		key := fmt.Sprintf("%s-%04d", prefix, i)
		if i%2 == 0 {
			envs[i] = h.newEnvelopeSigned("t_db", key, "create_ticket", map[string]any{"title": "db fault " + key}, assertion)
		} else {
			envs[i] = h.newEnvelopeSigned("t_db", key, "refund_order", map[string]any{
				"order_id": fmt.Sprintf("ord_%s%d", prefix, i), "amount_cents": 100 + i, "currency": "AUD",
			}, assertion)
		}
	}
	return envs
}

// dbSubmitPaced publishes envs in waves of size wave, one wave per
// every, so that the processors see many batches (and so many
// transactions) rather than one. before, if set, runs before each wave
// with its number.
func (h *dbHarness) dbSubmitPaced(envs []envelope, wave int, every time.Duration, before func(n int)) {
	h.t.Helper()
	tick := time.NewTicker(every)
	defer tick.Stop()
	for n := 0; n*wave < len(envs); n++ {
		if n > 0 {
			<-tick.C
		}
		if before != nil {
			before(n)
		}
		batch := envs[n*wave : min((n+1)*wave, len(envs))]
		recs := make([]*kgo.Record, len(batch))
		for i, e := range batch {
			recs[i] = &kgo.Record{Topic: h.kafka.Topics.Requests, Key: []byte(e.key().String()), Value: mustJSON(h.t, e)}
		}
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		err := h.pub.ProduceSync(ctx, recs...).FirstErr()
		cancel()
		if err != nil {
			h.t.Fatalf("publish wave %d: %v", n, err)
		}
	}
}

// dbOutcome is what dbCheck found.
type dbOutcome struct {
	states map[statemachine.State]int
	// requests counts every request that reached a tool, native replays
	// included; replays counts those.
	requests, replays int
	// reclaimed counts calls whose record's epoch is above 1: claimed
	// again after a lease expired.
	reclaimed int
	// resolved counts calls whose outcome was unknown and that the
	// reconciler resolved.
	resolved int
}

// dbCheck waits until every call is terminal and checks exactly-once at
// the far side: no duplicate effect at the tools, every succeeded call
// with exactly one effect and the four events of a clean run, its record
// succeeded. allowed lists the other end states a test accepts (each
// with no effect at all).
func (h *dbHarness) dbCheck(envs []envelope, timeout time.Duration, allowed ...statemachine.State) dbOutcome {
	h.t.Helper()
	t := h.t
	keys := make([]ledger.CallKey, len(envs))
	for i, e := range envs {
		keys[i] = e.key()
	}
	calls := h.waitTerminal(timeout, keys...)
	out := dbOutcome{states: map[statemachine.State]int{}}
	perKey := map[string]int{}
	for _, ef := range h.backend.Effects() {
		if ef.TenantID != "t_db" {
			continue
		}
		out.requests++
		perKey[ef.Tool+" "+ef.IdempotencyKey]++
		if ef.Replay {
			out.replays++
		}
	}
	for i, e := range envs {
		k := keys[i]
		c := calls[k]
		out.states[c.State]++
		applied := h.backend.AppliedIn(e.Tool, "t_db", k.String())
		if c.Anomalies != 0 {
			t.Errorf("%s: %d events did not fold: %s", k, c.Anomalies, eventTypes(c.Events))
		}
		var rec processors.Record
		// The pool may still hold connections a cut killed: each fails
		// once.
		ledgertest.WaitFor(t, 10*time.Second, func() (err error) {
			rec, err = h.store.Get(context.Background(), k)
			return err
		})
		if rec.Epoch > 1 {
			out.reclaimed++
		}
		// A reconciler resolves an unknown outcome by asking the tool,
		// whose answer is its effect count: the call succeeded with one
		// effect, or failed with none.
		const unknown = "1:requested 2:authorized 3:executing 4:outcome_unknown"
		events := eventTypes(c.Events)
		switch {
		case h.reconciling && (events == unknown+" 5:succeeded" || events == unknown+" 5:failed"):
			out.resolved++
			want, status := 1, processors.StatusSucceeded
			if c.State != statemachine.StateSucceeded {
				want, status = 0, processors.StatusFailed
			}
			if applied != want {
				t.Errorf("%s resolved %s with %d effects at the tool; want %d", k, c.State, applied, want)
			}
			if rec.Status != status {
				t.Errorf("%s: the index says %s, the store %s", k, c.State, rec.Status)
			}
			if last := c.Events[len(c.Events)-1]; last.Reason != executor.ReasonReconciled {
				t.Errorf("%s resolved %s for %q; want %q", k, c.State, last.Reason, executor.ReasonReconciled)
			}
		case c.State == statemachine.StateSucceeded:
			if applied != 1 {
				t.Errorf("%s succeeded with %d effects at the tool; want 1", k, applied)
			}
			if want := "1:requested 2:authorized 3:executing 4:succeeded"; events != want {
				t.Errorf("%s events = %s; want %s", k, events, want)
			}
			if rec.Status != processors.StatusSucceeded {
				t.Errorf("%s: the index says succeeded, the store %s", k, rec.Status)
			}
		case dbAllowed(c.State, allowed):
			if applied != 0 || perKey[e.Tool+" "+k.String()] != 0 {
				t.Errorf("%s ended %s with %d effects, %d requests at the tool; want none", k, c.State, applied, perKey[e.Tool+" "+k.String()])
			}
		default:
			last := c.Events[len(c.Events)-1]
			t.Errorf("%s ended %s (%s; %s %s); want succeeded", k, c.State, eventTypes(c.Events), last.Reason, last.Detail)
		}
	}
	if dups := h.backend.Duplicates(); len(dups) != 0 {
		t.Errorf("duplicate effects at the tools: %v", dups)
	}
	return out
}

func dbAllowed(s statemachine.State, allowed []statemachine.State) bool {
	for _, a := range allowed {
		if s == a {
			return true
		}
	}
	return false
}

// TestDBConnectionCutsLoseNothingDuplicateNothing cuts every connection
// of the store's pool several times while calls flow: statements,
// transactions and COMMITs die mid-flight, some of them after the server
// committed.
func TestDBConnectionCutsLoseNothingDuplicateNothing(t *testing.T) {
	h := newDBHarness(t, 8)
	h.startIntake("intake-db")
	h.startExecutor(h.executorConfig("executor-db"))
	envs := h.dbCalls("cut", 240)

	// Cuts at jittered intervals, independent of the load's waves: at
	// least 15, then on until three quarters of the load has run and ten
	// connections were cut (the processes' sweeps open connections after
	// the load, should it end first: it does once no outcome waits for a
	// lease to lapse).
	var rounds, cut int
	cutting := make(chan struct{})
	go func() {
		defer close(cutting)
		for i := 0; i < 60 && (i < 15 || cut < 10 || len(h.backend.Effects()) < len(envs)*3/4); i++ {
			select {
			case <-t.Context().Done():
				return
			case <-time.After(time.Duration(60+rand.IntN(120)) * time.Millisecond):
			}
			rounds++
			cut += h.proxy.CutAll()
		}
	}()
	h.dbSubmitPaced(envs, 12, 100*time.Millisecond, nil)
	<-cutting
	st := h.store.dbSnapshot()
	out := h.dbCheck(envs, 90*time.Second)

	if rounds < 10 || cut < 10 {
		t.Errorf("%d cut rounds closed %d connections; want at least 10 of each", rounds, cut)
	}
	if st.errs() == 0 {
		t.Errorf("no store call failed under %d cuts (%+v): the fault did not reach the ledger", cut, st)
	}
	t.Logf("%d calls %v; %d cut rounds closed %d connections; store %+v; %d tool requests, %d native replays, %d reclaimed; %d step failures redelivered",
		len(envs), out.states, rounds, cut, st, out.requests, out.replays, out.reclaimed, h.procLog.get("step failed, redelivering batch"))
}

// TestDBSlowQueriesLoseNothingDuplicateNothing makes every round trip to
// the database slow for a while, long enough that a claim and its
// completion outlast the claim's lease (2.1s here: one 2s attempt and a
// 100ms margin), with two executors sweeping each other's expired
// claims; then heals.
//
// A reconciler runs as in a deployment: how much of a lease a slow claim
// leaves depends on the machine's load, and a call started in the last
// milliseconds of its lease, or claimed again after its first owner may
// have called the tool, ends outcome_unknown until the tool is asked.
func TestDBSlowQueriesLoseNothingDuplicateNothing(t *testing.T) {
	h := newDBHarness(t, 8)
	h.startIntake("intake-db")
	for i := range 2 {
		cfg := h.executorConfig(fmt.Sprintf("executor-db-%d", i+1))
		cfg.MaxAttempts, cfg.RetryBackoff, cfg.LeaseMargin = 1, time.Millisecond, 100*time.Millisecond
		h.startExecutor(cfg)
	}
	h.startReconciler()
	envs := h.dbCalls("slow", 240)

	// Every round trip takes 700ms. On PostgreSQL a claim and a
	// completion make one each (BEGIN and COMMIT pipelined with their
	// statements), plus one on a connection's first use of a statement.
	// A lease runs from the claim's transaction on the server, so a
	// completion ends past it only when what comes between claim and
	// completion adds up to more than a lease, which on its own depends
	// on the machine's load. So the completions' COMMITs are also held
	// longer than a lease (their statements reach the server at once, in
	// the lease) until one has ended past it, whatever the machine: its
	// row stays locked meanwhile, and the other executor's sweep meets
	// it. The slowness lasts until then, and the calls keep coming.
	const (
		delay = 700 * time.Millisecond
		// A commit held past the lease (2.1s) by itself.
		commitDelay = 2500 * time.Millisecond
		wave        = 10
		// Kept for after the slowness.
		healed = 30
	)
	h.dbSubmitPaced(envs[:30], wave, 50*time.Millisecond, nil)
	waitEffects(h.harness, 10)
	h.proxy.SetDelay(delay)
	h.proxy.DelayCommitsOf(dbCompleteSQL, commitDelay)
	slowFrom := time.Now()
	next, last := 30, time.Time{} // the next call to submit; when the last wave went
	// Slow until a completion ended past its lease: a wave every 200ms,
	// at least 6 of them, then more until one has.
	ledgertest.WaitFor(t, 2*time.Minute, func() error {
		st := h.store.dbSnapshot()
		if st.LateCompletions > 0 {
			h.proxy.DelayCommitsOf(dbCompleteSQL, 0)
		}
		if st.LateCompletions > 0 && time.Since(slowFrom) >= 4*time.Second && next >= 90 {
			return nil
		}
		if next+wave <= len(envs)-healed && time.Since(last) >= 200*time.Millisecond {
			h.dbSubmitPaced(envs[next:next+wave], wave, time.Millisecond, nil)
			next, last = next+wave, time.Now()
		}
		return fmt.Errorf("slow for %v, %d calls submitted, %d completions past their lease (store %+v)",
			time.Since(slowFrom).Round(time.Second), next, st.LateCompletions, st)
	})
	h.proxy.SetDelay(0)
	h.proxy.DelayCommitsOf(dbCompleteSQL, 0)
	slowFor := time.Since(slowFrom)
	h.dbSubmitPaced(envs[next:], wave, 50*time.Millisecond, nil)
	// A claim so slow that its lease left no time to call the tool ends
	// the call failed (executor: deadline_exceeded, not_started), which
	// is right only if nobody called the tool: dbCheck wants a failed
	// call without a single request at its tool. A reclaimed call ends
	// outcome_unknown instead (its first owner may have called the
	// tool), and the reconciler asks the tool.
	out := h.dbCheck(envs, 90*time.Second, statemachine.StateFailed)

	st := h.store.dbSnapshot()
	ps := h.proxy.Stats()
	if ps.Delayed == 0 || ps.CommitsDelayed == 0 || st.LateCompletions == 0 {
		t.Errorf("%d round trips delayed, %d completions' commits held, %d completions past their lease; want all > 0", ps.Delayed, ps.CommitsDelayed, st.LateCompletions)
	}
	t.Logf("%d calls (%d while slow) %v; %v delay for %v: %d round trips delayed; store %+v; %d tool requests, %d native replays, %d reclaimed, %d unknown outcomes resolved",
		len(envs), next-30, out.states, delay, slowFor.Round(100*time.Millisecond), ps.Delayed, st, out.requests, out.replays, out.reclaimed, out.resolved)
}

// TestDBAmbiguousCommitsResolved lets COMMITs of admissions, claims and
// completions reach the server and cuts the connection before the answer
// comes back: each transaction committed, and its client got an error.
// Nothing may run twice because of it: every call reaches its tool
// exactly once, not even a native replay.
func TestDBAmbiguousCommitsResolved(t *testing.T) {
	h := newDBHarness(t, 8)
	h.startIntake("intake-db")
	h.startExecutor(h.executorConfig("executor-db"))
	envs := h.dbCalls("ambiguous", 200)

	var claims, completions, admissions []*storetest.CommitCut
	h.dbSubmitPaced(envs, 10, 150*time.Millisecond, func(n int) {
		// One cut of each kind armed every few waves, so that they hit
		// different batches.
		switch n % 6 {
		case 1:
			admissions = append(admissions, h.proxy.CutAfterCommitOf(1, dbAdmitSQL))
		case 2:
			claims = append(claims, h.proxy.CutAfterCommitOf(1, dbClaimSQL))
		case 4:
			completions = append(completions, h.proxy.CutAfterCommitOf(1, dbCompleteSQL))
		}
	})
	out := h.dbCheck(envs, 90*time.Second)

	sum := func(cs []*storetest.CommitCut) (fired, committed, failed int) {
		for _, c := range cs {
			fired, committed, failed = fired+c.Fired(), committed+c.Committed(), failed+c.Failed()
		}
		return fired, committed, failed
	}
	cf, cc, _ := sum(claims)
	pf, pc, pfailed := sum(completions)
	af, ac, _ := sum(admissions)
	// A completion whose cut COMMIT failed (a serialization failure at
	// commit) did not record the outcome: its calls run again, with
	// the same downstream key, once their leases expire. Any other
	// second request would be the ledger running a call twice.
	if pfailed == 0 && (out.requests != len(envs) || out.replays != 0) {
		t.Errorf("%d requests at the tools (%d replays) for %d calls; want one each, no replay", out.requests, out.replays, len(envs))
	}
	if cc == 0 || pc == 0 || ac == 0 {
		t.Errorf("committed but cut: %d of %d claims, %d of %d completions, %d of %d admissions; want some of each", cc, cf, pc, pf, ac, af)
	}
	st := h.store.dbSnapshot()
	// A claim that committed unseen leaves its calls executing under
	// this executor's lease: busy on redelivery, claimed again once the
	// lease expired.
	if cc > 0 && st.Reclaims == 0 {
		t.Errorf("%d claims committed unseen and none was claimed again", cc)
	}
	t.Logf("%d calls %v; cut after commit (fired/committed): claims %d/%d, completions %d/%d, admissions %d/%d; store %+v; %d tool requests; %d step failures redelivered",
		len(envs), out.states, cf, cc, pf, pc, af, ac, st, out.requests, h.procLog.get("step failed, redelivering batch"))
}

// TestDBSerializationFailuresRetried runs three executors on one store
// and topic while a SERIALIZABLE side writer keeps rewriting the rows
// they claim and complete (to their own values). On CockroachDB, where
// the store's transactions are SERIALIZABLE, they fail with 40001 (and
// 40P01) and are retried; on PostgreSQL claims and completions run at
// READ COMMITTED and wait for the writer instead (deadlocks are still
// retried). Either way every call runs once (dbCheck).
func TestDBSerializationFailuresRetried(t *testing.T) {
	h := newDBHarness(t, 12)
	h.startIntake("intake-db")
	for i := range 3 {
		h.startExecutor(h.executorConfig(fmt.Sprintf("executor-db-%d", i+1)))
	}
	envs := h.dbCalls("serial", 240)

	ctx, stop := context.WithCancel(t.Context())
	defer stop()
	var side dbSideWriter
	done := make(chan error, 1)
	go func() { done <- side.run(ctx, h.pgDSN, pgx.Identifier{h.pgSchema, "execution_records"}.Sanitize()) }()
	h.dbSubmitPaced(envs, 12, 100*time.Millisecond, nil)
	out := h.dbCheck(envs, 90*time.Second)
	stop()
	if err := <-done; err != nil {
		t.Errorf("side writer: %v", err)
	}

	serial, deadlocks := h.storeLog.get(dbRetryMsg+" 40001"), h.storeLog.get(dbRetryMsg+" 40P01")
	if side.commits.Load() == 0 {
		t.Errorf("the side writer never committed (%d failed): it disturbed nothing", side.conflicts.Load())
	}
	if h.store.CockroachDB() && serial == 0 {
		t.Errorf("the store retried no serialization failure; the side writer committed %d times (%d failed); want retries on CockroachDB", side.commits.Load(), side.conflicts.Load())
	}
	st := h.store.dbSnapshot()
	t.Logf("%d calls %v; store retries: %d after 40001, %d after 40P01, %d in all; side writer: %d commits, %d serialization failures; store %+v; %d tool requests, %d native replays",
		len(envs), out.states, serial, deadlocks, h.storeLog.get(dbRetryMsg), side.commits.Load(), side.conflicts.Load(), st, out.requests, out.replays)
}

// dbSideWriter rewrites, in SERIALIZABLE transactions, rows that the
// ledger is about to claim or complete, to the values they have: it
// changes nothing but row versions, which is what makes a concurrent
// claim or completion fail with a serialization failure.
type dbSideWriter struct {
	commits, conflicts atomic.Int64
}

func (w *dbSideWriter) run(ctx context.Context, dsn, table string) error {
	conn, err := pgx.Connect(ctx, dsn)
	if err != nil {
		return err
	}
	defer conn.Close(context.Background())
	// The whole-table read gives the transaction a relation-wide
	// predicate lock, so that SSI sees it conflict with every ledger
	// writer; the update makes row-version conflicts with claims
	// (SELECT ... FOR UPDATE) and completions.
	read := `SELECT count(*) FROM ` + table + ` WHERE status IN ('authorized', 'executing')`
	touch := `UPDATE ` + table + ` SET updated_at = updated_at
WHERE (tenant_id, idempotency_key) IN (
  SELECT tenant_id, idempotency_key FROM ` + table + `
  WHERE status IN ('authorized', 'executing') ORDER BY random() LIMIT 8)`
	tick := time.NewTicker(2 * time.Millisecond)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-tick.C:
		}
		err := pgx.BeginTxFunc(ctx, conn, pgx.TxOptions{IsoLevel: pgx.Serializable}, func(tx pgx.Tx) error {
			var n int
			if err := tx.QueryRow(ctx, read).Scan(&n); err != nil {
				return err
			}
			_, err := tx.Exec(ctx, touch)
			return err
		})
		var pe *pgconn.PgError
		switch {
		case err == nil:
			w.commits.Add(1)
		case errors.As(err, &pe) && (pe.Code == "40001" || pe.Code == "40P01"):
			w.conflicts.Add(1)
		case ctx.Err() != nil:
			return nil
		default:
			return err
		}
	}
}

// dbStore is the SQL store as the processors see it, counting what its
// calls return. The rate limiter and the rest come through unchanged.
type dbStore struct {
	*pgstore.Store

	mu     sync.Mutex
	c      dbStoreCounts
	leases map[dbEpoch]time.Time // lease end of each claim made
}

// dbEpoch is one claim of a call.
type dbEpoch struct {
	key   ledger.CallKey
	epoch int64
}

// dbStoreCounts are dbStore's counters.
type dbStoreCounts struct {
	Admits, AdmitErrs       int
	Claims, ClaimErrs       int
	Reclaims                int // calls claimed again after their lease expired
	Completes, CompleteErrs int
	Fenced                  int // completions refused: the call was claimed again
	// LateCompletions counts completions that returned after the lease
	// of the claim they complete had ended.
	LateCompletions int
	// Others counts MarkLogged, Settle, Expired, Unlogged and Move (Get,
	// which the checks use, is not counted).
	Others, OtherErrs int
	// MaxClaim, MaxComplete: the longest call of each kind.
	MaxClaim, MaxComplete time.Duration
}

func (c dbStoreCounts) errs() int { return c.AdmitErrs + c.ClaimErrs + c.CompleteErrs + c.OtherErrs }

func (s *dbStore) dbSnapshot() dbStoreCounts {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.c
}

// other counts a call of the store's other methods.
func (s *dbStore) other(err error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.c.Others++
	if err != nil {
		s.c.OtherErrs++
	}
}

func (s *dbStore) MarkLogged(ctx context.Context, ls []processors.Logged) error {
	err := s.Store.MarkLogged(ctx, ls)
	s.other(err)
	return err
}

func (s *dbStore) Settle(ctx context.Context, journals []string, logged bool) error {
	err := s.Store.Settle(ctx, journals, logged)
	s.other(err)
	return err
}

func (s *dbStore) Expired(ctx context.Context, limit int) ([]processors.Record, error) {
	rs, err := s.Store.Expired(ctx, limit)
	s.other(err)
	return rs, err
}

func (s *dbStore) ExpiredAfter(ctx context.Context, after processors.Cursor, limit int) ([]processors.Record, error) {
	rs, err := s.Store.ExpiredAfter(ctx, after, limit)
	s.other(err)
	return rs, err
}

func (s *dbStore) Unlogged(ctx context.Context, olderThan time.Duration, after processors.Cursor, limit int) ([]processors.Record, error) {
	rs, err := s.Store.Unlogged(ctx, olderThan, after, limit)
	s.other(err)
	return rs, err
}

func (s *dbStore) Move(ctx context.Context, ms []processors.Move) ([]bool, error) {
	applied, err := s.Store.Move(ctx, ms)
	s.other(err)
	return applied, err
}

func (s *dbStore) Admit(ctx context.Context, as []processors.Admission) ([]processors.AdmitResult, error) {
	res, err := s.Store.Admit(ctx, as)
	s.mu.Lock()
	defer s.mu.Unlock()
	s.c.Admits++
	if err != nil {
		s.c.AdmitErrs++
	}
	return res, err
}

func (s *dbStore) Claim(ctx context.Context, cs []processors.Claim) ([]processors.ClaimResult, error) {
	start := time.Now()
	res, err := s.Store.Claim(ctx, cs)
	took := time.Since(start)
	s.mu.Lock()
	defer s.mu.Unlock()
	s.c.Claims++
	s.c.MaxClaim = max(s.c.MaxClaim, took)
	if err != nil {
		s.c.ClaimErrs++
		return res, err
	}
	for _, r := range res {
		switch r.Outcome {
		case processors.Reclaimed:
			s.c.Reclaims++
			fallthrough
		case processors.Claimed:
			s.leases[dbEpoch{r.Record.Key, r.Record.Epoch}] = r.Record.LeaseUntil
		}
	}
	return res, err
}

func (s *dbStore) Complete(ctx context.Context, cs []processors.Completion) ([]bool, error) {
	start := time.Now()
	applied, err := s.Store.Complete(ctx, cs)
	end := time.Now()
	s.mu.Lock()
	defer s.mu.Unlock()
	s.c.Completes++
	s.c.MaxComplete = max(s.c.MaxComplete, end.Sub(start))
	if err != nil {
		s.c.CompleteErrs++
		return applied, err
	}
	for i, c := range cs {
		if lease, ok := s.leases[dbEpoch{c.Key, c.Epoch}]; ok && end.After(lease) {
			s.c.LateCompletions++
		}
		if !applied[i] {
			s.c.Fenced++
		}
	}
	return applied, err
}

// dbCounts counts log records by message; the store's retries also by
// the SQLSTATE that caused them ("<message> 40001").
type dbCounts struct {
	mu sync.Mutex
	n  map[string]int
}

func newDBCounts() *dbCounts { return &dbCounts{n: make(map[string]int)} }

func (c *dbCounts) get(key string) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.n[key]
}

// dbLog is a slog handler that counts records at Info and above into
// its dbCounts and passes every record on to next.
type dbLog struct {
	c    *dbCounts
	next slog.Handler
}

func (l dbLog) Enabled(ctx context.Context, level slog.Level) bool {
	return level >= slog.LevelInfo || l.next.Enabled(ctx, level)
}

func (l dbLog) Handle(ctx context.Context, r slog.Record) error {
	if r.Level >= slog.LevelInfo {
		code := ""
		if r.Message == dbRetryMsg {
			r.Attrs(func(a slog.Attr) bool {
				if err, ok := a.Value.Any().(error); ok && a.Key == "err" {
					var pe *pgconn.PgError
					if errors.As(err, &pe) {
						code = pe.Code
					}
				}
				return true
			})
		}
		l.c.mu.Lock()
		l.c.n[r.Message]++
		if code != "" {
			l.c.n[r.Message+" "+code]++
		}
		l.c.mu.Unlock()
	}
	if !l.next.Enabled(ctx, r.Level) {
		return nil
	}
	return l.next.Handle(ctx, r)
}

func (l dbLog) WithAttrs(as []slog.Attr) slog.Handler { return dbLog{l.c, l.next.WithAttrs(as)} }
func (l dbLog) WithGroup(name string) slog.Handler    { return dbLog{l.c, l.next.WithGroup(name)} }
