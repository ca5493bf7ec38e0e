package chstore

import (
	"context"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"os"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"text/tabwriter"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"
	"golang.org/x/sync/errgroup"

	"github.com/toolcall-ledger/ledger/ledger"
	"github.com/toolcall-ledger/ledger/ledger/ledgertest"
	"github.com/toolcall-ledger/ledger/projections"
	"github.com/toolcall-ledger/ledger/projections/projectionstest"
	"github.com/toolcall-ledger/ledger/projections/projector"
	"github.com/toolcall-ledger/ledger/statemachine"
)

// The shape of BenchmarkLoad's generated logs.
const (
	// loadSeed generates the bulk log; loadLiveSeed the live one, whose
	// keys and ids are therefore other than the bulk log's.
	loadSeed     = 41
	loadLiveSeed = 43
	loadTenants  = 8
	loadSpan     = 24 * time.Hour
	loadPolicy   = 2 * time.Hour
	// loadRawEvents is how many events the raw floor inserts, in batches
	// of loadRawBatch; loadBatch is the events per Write of the bulk
	// ingest.
	loadRawEvents = 1_000_000
	loadRawBatch  = 100_000
	loadBatch     = 20_000
	// loadPartitions of the events topic in the live phase.
	loadPartitions = 12
	// loadCatchUp is how long the projector has to catch up once the
	// producer stops.
	loadCatchUp = 30 * time.Second
)

// loadStart is when the bulk log starts: a fixed day far from the clock,
// so that the live phase's events (at now) fall outside every window the
// queries ask about.
var loadStart = time.Date(2026, 6, 1, 0, 0, 0, 0, time.UTC)

// BenchmarkLoad is the projection's load benchmark, one run in one fresh
// database (dropped at the end), whatever b.N:
//
//  1. raw floor: plain batch inserts of the events-table rows of the
//     first 1M generated events, built beforehand, into a scratch copy
//     of the events table (dropped after);
//  2. bulk ingest: LEDGER_BENCH_EVENTS (default 5M) events over 24 h,
//     generated call by call and written with Store.Write in batches of
//     about 20k events, as the projector's sink path does;
//  3. projection lag: a producer paces LEDGER_BENCH_RATE (default 5000)
//     events/s for LEDGER_BENCH_LAG_SECONDS (default 60) onto a kfake
//     cluster of 12 partitions, while a projector writes them into the
//     same store; it must catch up within 30 s of the producer stopping;
//  4. query latency over the loaded tables: blast radius by jti, by
//     policy version over 24 h and by tool over 1 h, each answer checked
//     against counts taken while generating.
//
// It prints a summary table and reports every figure as a metric.
//
//	go test -run '^$' -bench BenchmarkLoad -benchtime 1x -timeout 60m ./projections/chstore/
func BenchmarkLoad(b *testing.B) {
	events := loadEnv(b, "LEDGER_BENCH_EVENTS", 5_000_000)
	rate := loadEnv(b, "LEDGER_BENCH_RATE", 5000)
	liveSeconds := loadEnv(b, "LEDGER_BENCH_LAG_SECONDS", 60)
	ctx := b.Context()
	s := openStore(b)

	mean := loadMeanEvents(loadSeed)
	cfg := projectionstest.LogConfig{
		Seed: loadSeed, Calls: max(1, int(math.Round(float64(events)/mean))), Tenants: loadTenants,
		Start: loadStart, Span: loadSpan, PolicyEvery: loadPolicy,
	}
	gen := projectionstest.NewGenerator(cfg)

	var sum loadSummary
	// The raw floor's rows are the first events of the same log, however
	// small the bulk one: a call's events do not depend on the number of
	// calls, only their times do.
	rawCfg := cfg
	rawCfg.Calls = max(cfg.Calls, int(loadRawEvents/mean)+1000)
	sum.raw = loadRawFloor(b, ctx, s, projectionstest.NewGenerator(rawCfg))
	sum.ingest = loadIngest(b, ctx, s, gen, int(float64(cfg.Calls)*mean))
	sum.live = loadLive(b, ctx, s, rate, liveSeconds)
	sum.queries = loadQueries(b, ctx, s, gen, sum.ingest.tally)
	sum.print(os.Stdout)
	sum.report(b)
}

// loadEnv reads a positive integer from the environment, def when unset.
func loadEnv(b *testing.B, name string, def int) int {
	b.Helper()
	v := os.Getenv(name)
	if v == "" {
		return def
	}
	n, err := strconv.Atoi(v)
	if err != nil || n <= 0 {
		b.Fatalf("%s=%q: want a positive integer", name, v)
	}
	return n
}

// loadMeanEvents is the mean number of events per generated call of seed,
// over a sample: the number of calls that makes a log of N events. A
// call's events do not depend on the number of calls.
func loadMeanEvents(seed uint64) float64 {
	const sample = 20000
	g := projectionstest.NewGenerator(projectionstest.LogConfig{Seed: seed, Calls: sample})
	n := 0
	for i := range sample {
		n += len(g.Call(i))
	}
	return float64(n) / sample
}

// loadRaw is the raw floor's figures.
type loadRaw struct {
	rows    int
	elapsed time.Duration
}

// loadRawFloor inserts the events-table rows of the generator's first
// loadRawEvents events into a scratch copy of the events table, in
// batches of loadRawBatch, and drops it: the floor Write is measured
// against, with no other table and no row building.
func loadRawFloor(b *testing.B, ctx context.Context, s *Store, gen *projectionstest.Generator) loadRaw {
	b.Helper()
	scratch := tableDef{name: "events_raw_floor", cols: eventsTable.cols}
	if err := s.conn.Exec(ctx, "CREATE TABLE "+s.table(scratch.name)+" AS "+s.table(eventsTable.name)); err != nil {
		b.Fatalf("create %s: %v", scratch.name, err)
	}
	var rows [][]any
	r := make(tableRows)
	for i := 0; i < gen.Calls() && len(rows) < loadRawEvents; i++ {
		for _, e := range gen.Call(i) {
			if err := eventRows(r, projections.Event{Event: e}); err != nil {
				b.Fatal(err)
			}
		}
		rows = append(rows, r[eventsTable.name]...)
		clear(r)
	}
	rows = rows[:min(len(rows), loadRawEvents)]
	fmt.Fprintf(os.Stderr, "raw floor: %d rows built, inserting\n", len(rows))
	begin := time.Now()
	for from := 0; from < len(rows); from += loadRawBatch {
		if err := s.insert(ctx, scratch, rows[from:min(from+loadRawBatch, len(rows))]); err != nil {
			b.Fatal(err)
		}
	}
	out := loadRaw{rows: len(rows), elapsed: time.Since(begin)}
	var n uint64
	if err := s.conn.QueryRow(ctx, "SELECT count() FROM "+s.table(scratch.name)).Scan(&n); err != nil {
		b.Fatal(err)
	}
	if n != uint64(len(rows)) {
		b.Fatalf("raw floor: %d rows in %s, want %d", n, scratch.name, len(rows))
	}
	if err := s.conn.Exec(ctx, "DROP TABLE "+s.table(scratch.name)); err != nil {
		b.Fatalf("drop %s: %v", scratch.name, err)
	}
	fmt.Fprintf(os.Stderr, "raw floor: %d rows in %s, %.0f rows/s\n", out.rows, out.elapsed.Round(time.Millisecond), float64(out.rows)/out.elapsed.Seconds())
	return out
}

// loadTally is what the queries over the bulk log must answer, counted
// while generating it, for windows within [from, until) in whole seconds.
type loadTally struct {
	from, until int64
	// policy counts, by version, the calls with a policy decision made
	// under it in the window; policyTenant the same by tenant.
	policy       map[string]int
	policyTenant map[string]map[string]int
	// requested counts calls by tenant and tool, per minute from `from`
	// of their requested event.
	requested map[[2]string][]int
}

func newLoadTally(start time.Time, span time.Duration) *loadTally {
	return &loadTally{
		from: start.Unix(), until: start.Add(span).Unix(),
		policy: make(map[string]int), policyTenant: make(map[string]map[string]int),
		requested: make(map[[2]string][]int),
	}
}

// add counts one call's events.
func (t *loadTally) add(evs []ledger.Event) {
	var versions []string
	for i := range evs {
		e := &evs[i]
		s := e.At.Unix()
		if e.Refusal() || s < t.from || s >= t.until {
			continue
		}
		if e.PolicyVersion != "" && projections.PolicyDecision(e.Decision) && !slices.Contains(versions, e.PolicyVersion) {
			versions = append(versions, e.PolicyVersion)
		}
		if e.Seq == 1 && e.Type == statemachine.EventRequested {
			k := [2]string{e.TenantID, e.Tool}
			m := t.requested[k]
			if m == nil {
				m = make([]int, (t.until-t.from)/60+1)
				t.requested[k] = m
			}
			m[(s-t.from)/60]++
		}
	}
	if len(versions) == 0 {
		return
	}
	tenant := evs[0].TenantID
	if t.policyTenant[tenant] == nil {
		t.policyTenant[tenant] = make(map[string]int)
	}
	for _, v := range versions {
		t.policy[v]++
		t.policyTenant[tenant][v]++
	}
}

// requestedIn is the number of calls of tool (of tenant, or of every
// tenant when it is empty) requested in [from, from+minutes) minutes.
func (t *loadTally) requestedIn(tenant, tool string, from, minutes int) int {
	n := 0
	for k, m := range t.requested {
		if k[1] != tool || tenant != "" && k[0] != tenant {
			continue
		}
		for _, c := range m[from : from+minutes] {
			n += c
		}
	}
	return n
}

// loadIngested is the bulk ingest's figures.
type loadIngested struct {
	events  int
	calls   int
	rows    map[string]uint64
	elapsed time.Duration
	// writing is the time spent in Write, the rest being waits for the
	// generator.
	writing time.Duration
	tally   *loadTally
}

func (l loadIngested) totalRows() uint64 {
	var n uint64
	for _, r := range l.rows {
		n += r
	}
	return n
}

// loadIngest streams the generator's log into s with Store.Write, in
// batches of about loadBatch events: a goroutine generates the next
// batch while the previous one is written. want is about how many events
// the log holds, for the progress lines.
func loadIngest(b *testing.B, ctx context.Context, s *Store, gen *projectionstest.Generator, want int) loadIngested {
	b.Helper()
	out := loadIngested{tally: newLoadTally(loadStart, loadSpan)}
	var nonRefusals int
	batches := make(chan projections.Batch, 2)
	g, gctx := errgroup.WithContext(ctx)
	g.Go(func() error {
		defer close(batches)
		batch := projections.Batch{Events: make([]projections.Event, 0, loadBatch+16)}
		for i := range gen.Calls() {
			evs := gen.Call(i)
			out.tally.add(evs)
			for _, e := range evs {
				if !e.Refusal() {
					nonRefusals++
				}
				batch.Events = append(batch.Events, projections.Event{Event: e, Offset: int64(out.events)})
				out.events++
			}
			if len(batch.Events) >= loadBatch || i == gen.Calls()-1 {
				select {
				case batches <- batch:
				case <-gctx.Done():
					return gctx.Err()
				}
				batch = projections.Batch{Events: make([]projections.Event, 0, loadBatch+16)}
			}
		}
		return nil
	})
	begin := time.Now()
	g.Go(func() error {
		done, lastPrint := 0, begin
		for batch := range batches {
			t := time.Now()
			if err := s.Write(gctx, batch); err != nil {
				return err
			}
			out.writing += time.Since(t)
			done += len(batch.Events)
			if time.Since(lastPrint) >= 5*time.Second {
				lastPrint = time.Now()
				el := time.Since(begin)
				r := float64(done) / el.Seconds()
				eta := time.Duration(float64(max(0, want-done)) / r * float64(time.Second))
				fmt.Fprintf(os.Stderr, "ingest: %d/~%d events in %s, %.0f events/s, ETA %s\n",
					done, want, el.Round(time.Second), r, eta.Round(time.Second))
			}
		}
		return nil
	})
	if err := g.Wait(); err != nil {
		b.Fatalf("bulk ingest: %v", err)
	}
	out.elapsed = time.Since(begin)
	out.calls = gen.Calls()

	// What Write inserted. Each row of events, event_keys and call_refs
	// has a sort key of its own (no row is written twice), so count()
	// is what was inserted, merged or not. calls collapses on merge to
	// one row per call: it got one row per event but refusals.
	out.rows = map[string]uint64{callsTable.name: uint64(nonRefusals)}
	for _, t := range []tableDef{eventsTable, eventKeysTable, callRefsTable} {
		var n uint64
		if err := s.conn.QueryRow(ctx, "SELECT count() FROM "+s.table(t.name)).Scan(&n); err != nil {
			b.Fatalf("count %s: %v", t.name, err)
		}
		out.rows[t.name] = n
	}
	if out.rows[eventsTable.name] != uint64(out.events) {
		b.Fatalf("bulk ingest: %d rows in events, want the %d events generated", out.rows[eventsTable.name], out.events)
	}
	fmt.Fprintf(os.Stderr, "ingest: %d events (%d calls) in %s, %.0f events/s, %.0f rows/s\n", out.events, out.calls,
		out.elapsed.Round(time.Millisecond), float64(out.events)/out.elapsed.Seconds(), float64(out.totalRows())/out.elapsed.Seconds())
	return out
}

// loadLived is the live phase's figures.
type loadLived struct {
	produced   int
	producing  time.Duration
	p50, p99   time.Duration
	latencyMax time.Duration
	lagTimeMax time.Duration
	lagRecsMax int64
	caughtUp   time.Duration
	batches    int64
}

// loadLive paces rate events/s for seconds onto a kfake cluster, each
// call's events on its partition, while a projector with default batching
// writes them into s. The projector must catch up within loadCatchUp once
// the producer stops.
func loadLive(b *testing.B, ctx context.Context, s *Store, rate, seconds int) loadLived {
	b.Helper()
	k := ledgertest.New(b, ledgertest.Options{Partitions: loadPartitions})
	group := k.Group("load-bench")
	p, err := projector.New(projector.Config{Client: k.Client, Topics: k.Topics, Group: group}, s)
	if err != nil {
		b.Fatal(err)
	}
	runCtx, stop := context.WithCancel(ctx)
	runErr := make(chan error, 1)
	go func() { runErr <- p.Run(runCtx) }()
	stopped := false
	stopProjector := func() {
		if !stopped {
			stopped = true
			stop()
			if err := <-runErr; err != nil {
				b.Errorf("projector: %v", err)
			}
		}
	}
	defer stopProjector()

	// Produce only once the projector holds its partitions, so that the
	// latency counts no group join.
	ledgertest.WaitFor(b, 30*time.Second, func() error {
		st, err := projector.Status(ctx, projector.StatusConfig{Client: k.Client, Topics: k.Topics, Group: group})
		if err != nil && !errors.Is(err, projector.ErrNeverCommitted) {
			return err
		}
		if st.State != "Stable" || st.Members != 1 {
			return fmt.Errorf("group %s is %s with %d members", group, st.State, st.Members)
		}
		return nil
	})

	var out loadLived
	// Sample the lag every 100ms until the projector caught up.
	sampled := make(chan struct{})
	var sampler sync.WaitGroup
	sampler.Go(func() {
		tick := time.NewTicker(100 * time.Millisecond)
		defer tick.Stop()
		for {
			select {
			case <-sampled:
				return
			case <-tick.C:
				l := p.Lag()
				out.lagTimeMax = max(out.lagTimeMax, l.Time)
				out.lagRecsMax = max(out.lagRecsMax, l.Records)
			}
		}
	})
	stopSampler := func() {
		select {
		case <-sampled:
		default:
			close(sampled)
			sampler.Wait()
		}
	}
	defer stopSampler()

	cl, err := ledger.NewClient(k.Client, kgo.RecordPartitioner(kgo.ManualPartitioner()))
	if err != nil {
		b.Fatal(err)
	}
	defer cl.Close()
	dur := time.Duration(seconds) * time.Second
	// More calls than the run needs, so that the pacing never runs out.
	calls := int(float64(rate*seconds)/loadMeanEvents(loadLiveSeed)*1.2) + 100
	gen := projectionstest.NewGenerator(projectionstest.LogConfig{
		Seed: loadLiveSeed, Calls: calls, Tenants: loadTenants,
		Start: time.Now().UTC(), Span: dur * 12 / 10, PolicyEvery: loadPolicy,
	})
	var (
		acked      atomic.Int64
		failed     atomic.Int64
		errOnce    sync.Once
		produceErr error
	)
	promise := func(_ *kgo.Record, err error) {
		if err != nil {
			failed.Add(1)
			errOnce.Do(func() { produceErr = err })
			return
		}
		acked.Add(1)
	}
	var (
		queue []ledger.Event
		next  int
	)
	tick := time.NewTicker(10 * time.Millisecond)
	begin := time.Now()
	lastPrint := begin
	for el := time.Duration(0); el < dur; el = time.Since(begin) {
		// Catch up with the schedule whenever a tick came late.
		for target := int(float64(rate) * el.Seconds()); out.produced < target; out.produced++ {
			if len(queue) == 0 {
				if next == gen.Calls() {
					b.Fatalf("live: the generator ran out of calls after %d events", out.produced)
				}
				queue = gen.Call(next)
				next++
			}
			rec, err := queue[0].Record(k.Topics.Events)
			if err != nil {
				b.Fatal(err)
			}
			queue = queue[1:]
			rec.Partition = ledger.PartitionFor(rec.Key, loadPartitions)
			cl.Produce(ctx, rec, promise)
		}
		if time.Since(lastPrint) >= 5*time.Second {
			lastPrint = time.Now()
			l := p.Lag()
			fmt.Fprintf(os.Stderr, "live: %d events produced in %s, projector lag %d records, %s\n",
				out.produced, el.Round(time.Second), l.Records, l.Time.Round(time.Millisecond))
		}
		select {
		case <-tick.C:
		case <-ctx.Done():
			b.Fatal(ctx.Err())
		}
	}
	tick.Stop()
	out.producing = time.Since(begin)
	stoppedAt := time.Now()
	if err := cl.Flush(ctx); err != nil {
		b.Fatalf("live: flush the producer: %v", err)
	}
	if n := failed.Load(); n > 0 {
		b.Fatalf("live: %d of %d records not produced: %v", n, out.produced, produceErr)
	}
	if n := acked.Load(); n != int64(out.produced) {
		b.Fatalf("live: %d records acknowledged, %d produced", n, out.produced)
	}

	// Caught up: nothing left between the committed offsets and the
	// ends, and every event produced written.
	deadline := stoppedAt.Add(loadCatchUp)
	for {
		l, m := p.Lag(), p.Metrics()
		if l.Records == 0 && m.Written >= int64(out.produced) {
			out.caughtUp = time.Since(stoppedAt)
			out.batches = m.Batches
			break
		}
		if time.Now().After(deadline) {
			b.Fatalf("live: the projector did not catch up within %s of the producer stopping: lag %d records (%s), %d of %d events written",
				loadCatchUp, l.Records, l.Time, m.Written, out.produced)
		}
		time.Sleep(20 * time.Millisecond)
	}
	stopSampler()
	stopProjector()
	h := p.Latency()
	out.p50, out.p99, out.latencyMax = h.Quantile(0.5), h.Quantile(0.99), h.Quantile(1)
	fmt.Fprintf(os.Stderr, "live: %d events in %s (%.0f/s), latency p50 %s p99 %s max %s, lag max %s, caught up %s after the producer stopped\n",
		out.produced, out.producing.Round(time.Millisecond), float64(out.produced)/out.producing.Seconds(),
		out.p50, out.p99, out.latencyMax, out.lagTimeMax, out.caughtUp.Round(time.Millisecond))
	return out
}

// loadTimings are the wall times of one kind of query.
type loadTimings struct {
	name string
	all  []time.Duration
	// tenant are the queries scoped to one tenant, all the others.
	tenant, across []time.Duration
}

func (l *loadTimings) add(tenant bool, d time.Duration) {
	l.all = append(l.all, d)
	if tenant {
		l.tenant = append(l.tenant, d)
	} else {
		l.across = append(l.across, d)
	}
}

// loadPercentile is the q-quantile of ds (nearest rank); 0 for none.
func loadPercentile(ds []time.Duration, q float64) time.Duration {
	if len(ds) == 0 {
		return 0
	}
	s := slices.Clone(ds)
	slices.Sort(s)
	return s[max(0, int(math.Ceil(q*float64(len(s))))-1)]
}

// loadQueries asks, over the loaded tables, blast radius by jti across
// tenants, by policy version over the 24 h, and by tool over 1 h windows,
// timing each question and checking its answer against the generator.
func loadQueries(b *testing.B, ctx context.Context, s *Store, gen *projectionstest.Generator, tally *loadTally) []*loadTimings {
	b.Helper()
	r := rand.New(rand.NewPCG(loadSeed, 7))
	ask := func(f projections.Filter) (projections.BlastRadius, time.Duration) {
		b.Helper()
		t := time.Now()
		br, err := s.BlastRadius(ctx, f)
		d := time.Since(t)
		if err != nil {
			b.Fatalf("blast radius %+v: %v", f, err)
		}
		return br, d
	}

	// (a) By jti, across tenants: calls that executed carry one.
	jti := &loadTimings{name: "jti (all tenants)"}
	for len(jti.all) < 200 {
		i := r.IntN(gen.Calls())
		evs := gen.Call(i)
		k := slices.IndexFunc(evs, func(e ledger.Event) bool { return e.JTI != "" })
		if k < 0 {
			continue
		}
		br, d := ask(projections.Filter{AllTenants: true, JTI: evs[k].JTI})
		if br.Total != 1 || len(br.Calls) != 1 || br.Calls[0].Key() != evs[k].Key() {
			b.Fatalf("jti %s: %d calls (%v), want exactly %s", evs[k].JTI, br.Total, br.Calls, evs[k].Key())
		}
		jti.add(false, d)
	}
	fmt.Fprintf(os.Stderr, "queries: %d by jti done\n", len(jti.all))

	// (b) By policy version over the 24 h: each version across tenants
	// and for each tenant.
	policy := &loadTimings{name: "policy version, 24 h"}
	versions := make([]string, 0, len(tally.policy))
	for v := range tally.policy {
		versions = append(versions, v)
	}
	slices.Sort(versions)
	since, until := loadStart, loadStart.Add(loadSpan)
	for _, v := range versions {
		check := func(tenant string, want int) {
			b.Helper()
			f := projections.Filter{Tenant: tenant, AllTenants: tenant == "", PolicyVersion: v, Since: since, Until: until}
			br, d := ask(f)
			if br.Total <= 0 || br.Total != want {
				b.Fatalf("policy version %s, tenant %q: %d calls, want %d", v, tenant, br.Total, want)
			}
			policy.add(tenant != "", d)
		}
		check("", tally.policy[v])
		for tn := range loadTenants {
			tenant := fmt.Sprintf("t_%02d", tn)
			if want := tally.policyTenant[tenant][v]; want > 0 {
				check(tenant, want)
			}
		}
	}
	fmt.Fprintf(os.Stderr, "queries: %d by policy version done\n", len(policy.all))

	// (c) By tool over random 1 h windows, on whole minutes, within the
	// 24 h: across tenants and for one tenant.
	tool := &loadTimings{name: "tool, 1 h"}
	const windows = 60
	spanMinutes := int(loadSpan / time.Minute)
	for i := range 2 * windows {
		tenant := ""
		if i%2 == 1 {
			tenant = fmt.Sprintf("t_%02d", r.IntN(loadTenants))
		}
		name := projectionstest.Tools[r.IntN(len(projectionstest.Tools))]
		from := r.IntN(spanMinutes - 60 + 1)
		f := projections.Filter{Tenant: tenant, AllTenants: tenant == "", Tool: name,
			Since: loadStart.Add(time.Duration(from) * time.Minute), Until: loadStart.Add(time.Duration(from+60) * time.Minute)}
		br, d := ask(f)
		if want := tally.requestedIn(tenant, name, from, 60); br.Total <= 0 || br.Total != want {
			b.Fatalf("tool %s, tenant %q, from minute %d: %d calls, want %d", name, tenant, from, br.Total, want)
		}
		tool.add(tenant != "", d)
	}
	fmt.Fprintf(os.Stderr, "queries: %d by tool done\n", len(tool.all))
	return []*loadTimings{jti, policy, tool}
}

// loadSummary is every figure of a run.
type loadSummary struct {
	raw     loadRaw
	ingest  loadIngested
	live    loadLived
	queries []*loadTimings
}

func loadMS(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }

// print writes the summary table.
func (s loadSummary) print(w *os.File) {
	tw := tabwriter.NewWriter(w, 2, 8, 2, ' ', tabwriter.AlignRight)
	row := func(cells ...string) {
		for _, c := range cells {
			fmt.Fprint(tw, c, "\t")
		}
		fmt.Fprintln(tw)
	}
	rate := func(n float64, d time.Duration) string { return fmt.Sprintf("%.0f", n/d.Seconds()) }
	ms := func(d time.Duration) string { return fmt.Sprintf("%.1f", loadMS(d)) }

	fmt.Fprintln(w, "\nBenchmarkLoad summary")
	row("step", "figure", "value")
	row("raw floor", "rows", strconv.Itoa(s.raw.rows))
	row("", "elapsed", s.raw.elapsed.Round(time.Millisecond).String())
	row("", "rows/s", rate(float64(s.raw.rows), s.raw.elapsed))
	in := s.ingest
	row("bulk ingest", "events (calls)", fmt.Sprintf("%d (%d)", in.events, in.calls))
	for _, t := range []tableDef{eventsTable, callsTable, callRefsTable, eventKeysTable} {
		row("", "rows "+t.name, strconv.FormatUint(in.rows[t.name], 10))
	}
	row("", "elapsed (in Write)", fmt.Sprintf("%s (%s)", in.elapsed.Round(time.Millisecond), in.writing.Round(time.Millisecond)))
	row("", "events/s", rate(float64(in.events), in.elapsed))
	row("", "rows/s", rate(float64(in.totalRows()), in.elapsed))
	row("", "events/s in Write", rate(float64(in.events), in.writing))
	l := s.live
	row("live", "events produced", strconv.Itoa(l.produced))
	row("", "produce rate /s", rate(float64(l.produced), l.producing))
	row("", "projector batches", strconv.FormatInt(l.batches, 10))
	row("", "latency p50 ms", ms(l.p50))
	row("", "latency p99 ms", ms(l.p99))
	row("", "latency max ms", ms(l.latencyMax))
	row("", "max Lag().Time ms", ms(l.lagTimeMax))
	row("", "max Lag().Records", strconv.FormatInt(l.lagRecsMax, 10))
	row("", "caught up after ms", ms(l.caughtUp))
	for _, q := range s.queries {
		row("query "+q.name, "count", strconv.Itoa(len(q.all)))
		row("", "p50 / p99 ms", ms(loadPercentile(q.all, 0.5))+" / "+ms(loadPercentile(q.all, 0.99)))
		if len(q.tenant) > 0 && len(q.across) > 0 {
			row("", "all tenants p50 / p99 ms", ms(loadPercentile(q.across, 0.5))+" / "+ms(loadPercentile(q.across, 0.99)))
			row("", "one tenant p50 / p99 ms", ms(loadPercentile(q.tenant, 0.5))+" / "+ms(loadPercentile(q.tenant, 0.99)))
		}
	}
	tw.Flush()
}

// report reports the figures as the benchmark's metrics.
func (s loadSummary) report(b *testing.B) {
	b.ReportMetric(float64(s.raw.rows)/s.raw.elapsed.Seconds(), "raw_rows/s")
	b.ReportMetric(float64(s.ingest.events)/s.ingest.elapsed.Seconds(), "ingest_events/s")
	b.ReportMetric(float64(s.ingest.totalRows())/s.ingest.elapsed.Seconds(), "ingest_rows/s")
	b.ReportMetric(float64(s.live.produced)/s.live.producing.Seconds(), "produce_events/s")
	b.ReportMetric(loadMS(s.live.p50), "lag_p50_ms")
	b.ReportMetric(loadMS(s.live.p99), "lag_p99_ms")
	b.ReportMetric(loadMS(s.live.latencyMax), "lag_max_ms")
	b.ReportMetric(loadMS(s.live.lagTimeMax), "lagtime_max_ms")
	names := []string{"jti", "policy24h", "tool1h"}
	for i, q := range s.queries {
		b.ReportMetric(loadMS(loadPercentile(q.all, 0.5)), names[i]+"_p50_ms")
		b.ReportMetric(loadMS(loadPercentile(q.all, 0.99)), names[i]+"_p99_ms")
	}
}
