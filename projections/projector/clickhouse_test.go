package projector

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"github.com/google/go-cmp/cmp/cmpopts"
	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/toolcall-ledger/ledger/ledger"
	"github.com/toolcall-ledger/ledger/ledger/ledgertest"
	"github.com/toolcall-ledger/ledger/projections"
	"github.com/toolcall-ledger/ledger/projections/chstore"
	"github.com/toolcall-ledger/ledger/projections/chstore/chtest"
	"github.com/toolcall-ledger/ledger/projections/projectionstest"
	"github.com/toolcall-ledger/ledger/statemachine"
)

// freshStore is a migrated ClickHouse projection in a database of its
// own, dropped when the test ends.
func freshStore(t *testing.T) *chstore.Store {
	t.Helper()
	st, err := chstore.Open(t.Context(), chstore.Config{DSN: chtest.DSN(t), Database: chtest.FreshDatabase(t)})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { st.Close() })
	if err := st.Migrate(t.Context()); err != nil {
		t.Fatal(err)
	}
	return st
}

// callRecord is e's record on k's events topic of n partitions, on its
// call's partition.
func callRecord(t *testing.T, k *ledgertest.Kafka, e ledger.Event, n int) *kgo.Record {
	t.Helper()
	r, err := e.Record(k.Topics.Events)
	if err != nil {
		t.Fatal(err)
	}
	r.Partition = ledger.PartitionFor(r.Key, n)
	return r
}

// readLog reads every committed event on the topic, as an auditor with a
// read_committed consumer would: the log the oracle answers from.
func readLog(t *testing.T, k *ledgertest.Kafka) []ledger.Event {
	t.Helper()
	adm := admin(t, k)
	ends := highWatermarks(t, adm, k)[k.Topics.Events]
	cl, err := ledger.NewClient(k.Client,
		kgo.ConsumeTopics(k.Topics.Events),
		kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()),
		kgo.FetchIsolationLevel(kgo.ReadCommitted()),
		kgo.KeepControlRecords(),
	)
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	next := map[int32]int64{}
	var log []ledger.Event
	ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
	defer cancel()
	done := func() bool {
		for p, end := range ends {
			if next[p] < end {
				return false
			}
		}
		return true
	}
	for !done() {
		fs := cl.PollFetches(ctx)
		if ctx.Err() != nil {
			t.Fatalf("reading the log back: %v (at %v of %v)", ctx.Err(), next, ends)
		}
		fs.EachRecord(func(r *kgo.Record) {
			next[r.Partition] = r.Offset + 1
			if r.Attrs.IsControl() {
				return
			}
			e, err := ledger.DecodeEvent(r.Value)
			if err != nil {
				t.Fatalf("log record %d/%d: %v", r.Partition, r.Offset, err)
			}
			log = append(log, e)
		})
	}
	return log
}

// The whole projection path on the real engines: a log with committed and
// aborted transactions and re-published events goes through the projector
// into ClickHouse, part of it twice (a projector that wrote and died
// before committing), and is then rebuilt from the log into fresh tables.
// The live projection and the rebuild have equal checksums over every
// table and give the oracle's answers, computed from the log as a
// read_committed reader sees it; no event of an aborted transaction is
// anywhere; replaying the log once more changes nothing.
func TestClickHouseLiveAndRebuild(t *testing.T) {
	const partitions = 4
	k := ledgertest.New(t, ledgertest.Options{Partitions: partitions})
	cfg := projectionstest.LogConfig{Seed: 11, Calls: 1500, Tenants: 5}
	log := projectionstest.Log(cfg)

	// What aborted transactions carry: whole calls that never happened,
	// and steps of real calls that never happened (a failure after the
	// call's last event). Either would change answers if it showed.
	var aborted []ledger.Event
	var abortedOnly ledger.CallKey
	for i, e := range projectionstest.Log(projectionstest.LogConfig{Seed: 12, Calls: 40, Tenants: 5}) {
		e.EventID = fmt.Sprintf("aborted-%d", i)
		aborted = append(aborted, e)
		abortedOnly = e.Key()
	}
	oracleOfLog := projectionstest.NewOracle(log)
	for i, key := range oracleOfLog.Keys()[:60] {
		evs := oracleOfLog.Events(key)
		if len(evs) == 0 {
			continue
		}
		last := evs[len(evs)-1]
		last.EventID, last.Seq, last.Type, last.Reason = fmt.Sprintf("aborted-step-%d", i), last.Seq+1, statemachine.EventFailed, "never_happened"
		last.JTI = "jti-aborted"
		aborted = append(aborted, last)
	}

	// Produce the log in transactions of up to 50 events, the events of
	// a call on the call's partition, with an aborted transaction now and
	// then.
	record := func(e ledger.Event) *kgo.Record { return callRecord(t, k, e, partitions) }
	r := rand.New(rand.NewPCG(5, 5))
	txn := 0
	for i := 0; i < len(log); {
		n := min(1+r.IntN(50), len(log)-i)
		recs := make([]*kgo.Record, 0, n)
		for _, e := range log[i : i+n] {
			recs = append(recs, record(e))
		}
		i += n
		txn++
		produceTxn(t, k, fmt.Sprintf("producer-%d", txn%3), kgo.TryCommit, recs...)
		if len(aborted) > 0 && txn%4 == 0 {
			m := min(10, len(aborted))
			var bad []*kgo.Record
			for _, e := range aborted[:m] {
				bad = append(bad, record(e))
			}
			aborted = aborted[m:]
			produceTxn(t, k, fmt.Sprintf("producer-%d", txn%3), kgo.TryAbort, bad...)
		}
	}
	if len(aborted) > 0 {
		t.Fatalf("%d aborted events were never produced: make the log longer", len(aborted))
	}
	produce(t, k, spread([]*kgo.Record{actionRecord(t, k.Topics.Control, "refund_order"), actionRecord(t, k.Topics.Control, "send_email")}, partitions)...)

	committedLog := readLog(t, k)
	oracle := projectionstest.NewOracle(committedLog)
	for _, e := range committedLog {
		if e.JTI == "jti-aborted" || e.Reason == "never_happened" {
			t.Fatalf("the read_committed reader sees an aborted event %s: the broker is not testing what this test thinks", e.EventID)
		}
	}
	if diff := cmp.Diff(projectionstest.NewOracle(log).Keys(), oracle.Keys()); diff != "" {
		t.Fatalf("the log read back is not the log produced (-produced +read):\n%s", diff)
	}

	// A projector that wrote the first third and died before committing:
	// its batches are in ClickHouse, its offsets are not.
	live := freshStore(t)
	projectionstest.Write(t, live, committedLog[:len(committedLog)/3], 500)
	p, stop := start(t, k, k.Group("projector"), live, func(c *Config) { c.MaxBatch = 700 })
	waitCaughtUp(t, admin(t, k), k, k.Group("projector"))
	stop()
	if m := p.Metrics(); m.Undecodable != 0 || m.WriteErrors != 0 {
		t.Errorf("projector metrics %+v: want no undecodable records and no write errors", m)
	}

	rebuilt := freshStore(t)
	prog, err := Replay(t.Context(), ReplayConfig{Client: k.Client, Topics: k.Topics, MaxBatch: 900}, rebuilt, nil)
	if err != nil {
		t.Fatal(err)
	}
	if want := int64(len(committedLog) + 2); prog.Done != want {
		t.Errorf("replay wrote %d records, want the %d committed ones", prog.Done, want)
	}

	liveSums, err := live.Checksums(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	rebuiltSums, err := rebuilt.Checksums(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	if diff := cmp.Diff(liveSums, rebuiltSums); diff != "" {
		t.Errorf("live and rebuilt checksums differ (-live +rebuilt):\n%s", diff)
	}
	distinct := map[string]bool{}
	for _, e := range committedLog {
		distinct[e.EventID] = true
	}
	if got := liveSums["events"].Rows; got != uint64(len(distinct)) {
		t.Errorf("events table holds %d distinct rows, the log %d distinct events", got, len(distinct))
	}
	for name, sum := range liveSums {
		if sum.Rows == 0 && name != "schema_migrations" {
			t.Errorf("table %s is empty: the checksums compare nothing", name)
		}
	}

	// Both answer as the oracle does, every blast radius by jti
	// included, and nothing of the aborted transactions shows.
	for name, st := range map[string]*chstore.Store{"live": live, "rebuilt": rebuilt} {
		t.Run(name, func(t *testing.T) {
			projectionstest.Check(t, st, oracle, cfg)
			if name == "live" {
				// The rebuild's tables have the live ones' checksums.
				checkEveryJTI(t, st, oracle)
			}
			br, err := st.BlastRadius(t.Context(), projections.Filter{AllTenants: true, JTI: "jti-aborted"})
			if err != nil || br.Total != 0 {
				t.Errorf("blast radius of the aborted transactions' jti: %d calls, %v; want none", br.Total, err)
			}
			if _, err := st.Trace(t.Context(), abortedOnly); !errors.Is(err, projections.ErrNotFound) {
				t.Errorf("Trace of a call only an aborted transaction held: %v, want ErrNotFound", err)
			}
		})
	}

	// Replaying the whole log into the rebuilt tables once more changes
	// no checksum.
	if _, err := Replay(t.Context(), ReplayConfig{Client: k.Client, Topics: k.Topics, MaxBatch: 333}, rebuilt, nil); err != nil {
		t.Fatal(err)
	}
	again, err := rebuilt.Checksums(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	if diff := cmp.Diff(rebuiltSums, again); diff != "" {
		t.Errorf("checksums changed when the log was projected twice (-once +twice):\n%s", diff)
	}
}

// checkEveryJTI asks the blast radius of every credential in the log
// across tenants (every tenth in its tenant too), and of a sample of
// families.
func checkEveryJTI(t *testing.T, st projections.Queries, o *projectionstest.Oracle) {
	t.Helper()
	asked := 0
	families := map[string]bool{}
	for _, k := range o.Keys() {
		evs := o.Events(k)
		i := slices.IndexFunc(evs, func(e ledger.Event) bool { return e.JTI != "" })
		if i < 0 {
			continue
		}
		e := evs[i]
		filters := []projections.Filter{{AllTenants: true, JTI: e.JTI}}
		if asked%10 == 0 {
			filters = append(filters, projections.Filter{Tenant: e.TenantID, JTI: e.JTI})
		}
		for _, f := range filters {
			want, err := f.Check()
			if err != nil {
				t.Fatal(err)
			}
			got, err := st.BlastRadius(t.Context(), f)
			if err != nil {
				t.Fatalf("BlastRadius(%+v): %v", f, err)
			}
			if diff := cmp.Diff(o.BlastRadius(want), got, cmpopts.EquateEmpty()); diff != "" {
				t.Errorf("BlastRadius(jti %s) (-oracle +clickhouse):\n%s", e.JTI, diff)
			}
			if got.Total != 1 {
				t.Errorf("jti %s: %d calls, want its one call", e.JTI, got.Total)
			}
		}
		asked++
		if len(families) < 25 && !families[e.CredentialFamily] {
			families[e.CredentialFamily] = true
			f := projections.Filter{AllTenants: true, CredentialFamily: e.CredentialFamily}
			want, _ := f.Check()
			got, err := st.BlastRadius(t.Context(), f)
			if err != nil {
				t.Fatal(err)
			}
			if diff := cmp.Diff(o.BlastRadius(want), got, cmpopts.EquateEmpty()); diff != "" {
				t.Errorf("BlastRadius(family %s) (-oracle +clickhouse):\n%s", e.CredentialFamily, diff)
			}
		}
	}
	if asked < 500 {
		t.Fatalf("only %d credentials in the log", asked)
	}
}

// A ClickHouse restored from a backup taken before the projector's last
// batches lacks records the group has committed past. The projector finds
// it from the ends the projection records with each batch, and reads the
// records again: at the next batch of a partition (lagRefresh of an hour:
// only the batch's check runs), and for a partition no record comes to,
// at the next lag refresh. Before, the records were missing for good,
// without a word. A partition empty when the backup was taken has its
// end recorded all the same (at a lag refresh), so that what it received
// after is read again too. A restore that empties the tables, then fills
// them one by one, as backup tools do, leaves the projection with no end
// for a while: the projector records none meanwhile, or it would outlast
// the backup's and hide what the backup lacks.
func TestClickHouseRestoredFromBackup(t *testing.T) {
	for _, tc := range []struct {
		name       string
		after      bool // records come to every partition after the restore
		lagRefresh time.Duration
		// empty: partition 2 has no record until after the backup.
		empty bool
		// refill: the restore drops the tables and fills new ones in
		// name order, a few lag refreshes apart; else one RENAME.
		refill bool
		// restart: the projector is restarted once the tables are
		// dropped, before they are filled.
		restart bool
	}{
		{"records come", true, time.Hour, false, false, false},
		{"no record comes", false, 100 * time.Millisecond, false, false, false},
		{"a partition empty at the backup", false, 100 * time.Millisecond, true, false, false},
		{"tables refilled", true, 100 * time.Millisecond, false, true, false},
		{"tables refilled across a restart", true, 100 * time.Millisecond, true, true, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			const partitions = 3
			k := ledgertest.New(t, ledgertest.Options{Partitions: partitions})
			cfg := projectionstest.LogConfig{Seed: 21, Calls: 600, Tenants: 3}
			log := projectionstest.Log(cfg)
			record := func(e ledger.Event) *kgo.Record { return callRecord(t, k, e, partitions) }
			produceLog := func(evs []ledger.Event) {
				recs := make([]*kgo.Record, 0, len(evs))
				for _, e := range evs {
					recs = append(recs, record(e))
				}
				produce(t, k, recs...)
			}
			third := len(log) / 3
			produced := log[:2*third]
			if tc.after {
				produced = log
			}
			// Before and after the backup, each partition's events in
			// the log's order.
			var before, between []ledger.Event
			for i, e := range log[:2*third] {
				if i < third && !(tc.empty && record(e).Partition == 2) {
					before = append(before, e)
				} else {
					between = append(between, e)
				}
			}

			live := freshStore(t)
			adm := admin(t, k)
			group := k.Group("restored")
			produceLog(before)
			mod := func(c *Config) { c.MaxBatch, c.LagRefresh = 100, tc.lagRefresh }
			p, stop := start(t, k, group, live, mod)
			waitCaughtUp(t, adm, k, group)
			if tc.empty {
				ledgertest.WaitFor(t, 10*time.Second, func() error {
					pos, err := live.Positions(t.Context())
					if err != nil {
						return err
					}
					if end, ok := pos.Lookup(k.Topics.Events, 2); !ok || end != 0 {
						return fmt.Errorf("the empty partition's end: %d, %v; want 0 recorded", end, ok)
					}
					return nil
				})
			}

			// The backup: a copy of every table now.
			backup := freshStore(t)
			tables := []string{"call_refs", "calls", "control_actions", "event_keys", "events", "projection_positions"}
			copyTables := func(to, from *chstore.Store, pause time.Duration) {
				for _, table := range tables {
					chtest.Exec(t, chtest.DSN(t), fmt.Sprintf("INSERT INTO `%s`.`%s` SELECT * FROM `%s`.`%s`", to.Database(), table, from.Database(), table))
					time.Sleep(pause)
				}
			}
			copyTables(backup, live, 0)
			produceLog(between)
			waitCaughtUp(t, adm, k, group)
			if tc.restart {
				// Every partition, the idle ones too, is committed
				// saying the projection had an end there.
				waitEndsMarked(t, adm, k, group)
			}
			// The restore, under the running projector.
			if tc.refill {
				if err := live.Reset(t.Context()); err != nil {
					t.Fatal(err)
				}
				if err := live.Migrate(t.Context()); err != nil {
					t.Fatal(err)
				}
				if tc.restart {
					stop()
					p, _ = start(t, k, group, live, mod)
				}
				// Records come while the tables are refilled.
				produceLog(log[2*third:])
				time.Sleep(3 * tc.lagRefresh)
				copyTables(live, backup, tc.lagRefresh)
			} else {
				if err := live.Swap(t.Context(), backup); err != nil {
					t.Fatal(err)
				}
				if tc.after {
					produceLog(log[2*third:])
				}
			}

			distinct := map[string]bool{}
			for _, e := range produced {
				distinct[e.EventID] = true
			}
			ledgertest.WaitFor(t, 30*time.Second, func() error {
				sums, err := live.Checksums(t.Context())
				if err != nil {
					return err
				}
				if got := sums["events"].Rows; got != uint64(len(distinct)) {
					return fmt.Errorf("the projection holds %d events of the %d produced", got, len(distinct))
				}
				return nil
			})
			waitCaughtUp(t, adm, k, group)
			// Each partition the restore lacks records of is read
			// again, once: a lag refresh that found it lacking
			// again before the first reread was applied read it
			// twice. (A refill holds partitions and reads them again
			// from where each batch started, as many times as batches
			// come.)
			lacking := map[int32]bool{}
			for _, e := range between {
				lacking[record(e).Partition] = true
			}
			if m := p.Metrics(); tc.refill && m.Rereads == 0 || !tc.refill && m.Rereads != int64(len(lacking)) {
				t.Errorf("projector metrics %+v: want the %d partitions the restore lacks records of read again once each", m, len(lacking))
			}
			// Every event is back (above); the answers from them are
			// asked of two restores (the questions take most of a case's
			// time).
			if tc.after {
				projectionstest.Check(t, live, projectionstest.NewOracle(produced), cfg)
			}
		})
	}
}

// waitEndsMarked waits until group has committed every partition of k's
// topics with endsMark.
func waitEndsMarked(t *testing.T, adm *kadm.Client, k *ledgertest.Kafka, group string) {
	t.Helper()
	ledgertest.WaitFor(t, 30*time.Second, func() error {
		resps, err := adm.FetchOffsets(t.Context(), group)
		if err != nil {
			return err
		}
		for topic, ps := range highWatermarks(t, adm, k) {
			for partition := range ps {
				if r, ok := resps.Lookup(topic, partition); !ok || r.Metadata != endsMark {
					return fmt.Errorf("%s/%d committed with metadata %q (%v); want %q", topic, partition, r.Metadata, ok, endsMark)
				}
			}
		}
		return nil
	})
}

// A partition no record comes to is committed by no batch; the lag
// refresh commits it where the group is, saying the projection has an end
// there, so that the projector started after it (a restart, a rebalance)
// holds the partition while a restore has taken its end away, and goes
// on once the end is back. Before, the new projector knew nothing of the
// end: it recorded one where the group was, and wrote what came.
func TestClickHouseIdlePartitionEndsOutliveRestarts(t *testing.T) {
	k := ledgertest.New(t, ledgertest.Options{Partitions: 1})
	ev := k.Topics.Events
	adm := admin(t, k)
	group := k.Group("idle-marked")
	produce(t, k, eventRecords(t, ev, ids("i", 10))...)
	// Where rebuild --swap leaves a group: committed from outside,
	// without the mark, the ends recorded.
	if err := CommitOffsets(t.Context(), k.Client, group, map[string]map[int32]int64{ev: {0: 10}}); err != nil {
		t.Fatal(err)
	}
	live := freshStore(t)
	if err := live.RecordEnds(t.Context(), []projections.End{{Topic: ev, Partition: 0, Next: 10}}); err != nil {
		t.Fatal(err)
	}
	mod := func(c *Config) { c.LagRefresh, c.MaxWait = 100*time.Millisecond, 20*time.Millisecond }
	_, stop := start(t, k, group, live, mod)
	waitEndsMarked(t, adm, k, group)
	if got := committed(t, adm, group)[ev][0]; got != 10 {
		t.Fatalf("committed %d after marking; want 10, where the group was", got)
	}
	stop()

	// A restore takes the ends away; a projector starts meanwhile.
	chtest.Exec(t, chtest.DSN(t), "TRUNCATE TABLE `"+live.Database()+"`.`projection_positions`")
	start(t, k, group, live, mod)
	produce(t, k, eventRecords(t, ev, ids("j", 10))...)
	time.Sleep(time.Second)
	if got := committed(t, adm, group)[ev][0]; got != 10 {
		t.Errorf("committed %d while the end is gone; want the group held at 10", got)
	}
	if rows, err := live.EventRows(t.Context()); err != nil || rows != 0 {
		t.Errorf("events rows %d, %v while the end is gone; want none written", rows, err)
	}
	// (The control topic's partition, empty, gets its end again: the
	// log has nothing before it that a restore could lack.)
	if pos, err := live.Positions(t.Context()); err != nil {
		t.Fatal(err)
	} else if end, ok := pos.Lookup(ev, 0); ok {
		t.Errorf("the events partition's end recorded at %d while it is gone; want none", end)
	}

	if err := live.RecordEnds(t.Context(), []projections.End{{Topic: ev, Partition: 0, Next: 10}}); err != nil {
		t.Fatal(err)
	}
	waitCaughtUp(t, adm, k, group)
	if rows, err := live.EventRows(t.Context()); err != nil || rows != 10 {
		t.Errorf("events rows %d, %v; want the 10 produced after the restart", rows, err)
	}
}

// A database restored from a backup older than the log's retention ends
// before the log start, on a partition retention has emptied: no fetch
// returns a record there to find the gap by, so the lag refresh, which
// knows the log start, stops the projector (ErrRecordsDeleted) for
// skip-deleted to accept the loss. Before, it said it read the records
// again and waited for them for good.
func TestClickHouseEndsBeforeAnEmptiedLog(t *testing.T) {
	_, k := deletedLog(t, "rs", "r", 10)
	ev := k.Topics.Events
	group := k.Group("emptied")
	if err := CommitOffsets(t.Context(), k.Client, group, map[string]map[int32]int64{ev: {0: 10}}); err != nil {
		t.Fatal(err)
	}
	st := freshStore(t)
	if err := st.RecordEnds(t.Context(), []projections.End{{Topic: ev, Partition: 0, Next: 4}}); err != nil {
		t.Fatal(err)
	}
	p, err := runToStop(t, k, group, st, func(c *Config) { c.LagRefresh = 100 * time.Millisecond })
	if !errors.Is(err, ErrRecordsDeleted) {
		t.Fatalf("Run over a projection ending at 4 of a partition emptied up to 10 = %v; want ErrRecordsDeleted", err)
	}
	// Read again once (found), then the gap: not counted as read again
	// by a lag refresh before the projector stopped.
	if m := p.Metrics(); m.Gaps != 1 || m.Rereads != 1 {
		t.Errorf("projector metrics %+v; want one gap, one partition read again", m)
	}
}

// countingSink counts the projection's Positions reads.
type countingSink struct {
	*chstore.Store
	reads atomic.Int64
}

func (s *countingSink) Positions(ctx context.Context) (projections.Positions, error) {
	s.reads.Add(1)
	return s.Store.Positions(ctx)
}

// A partition held because its end is gone (a restore refilling the
// tables) is not fetched until its end is back, and the others go on
// meanwhile. Before, each flush re-read and held the same records, asking
// ClickHouse for the ends every batch wait while the restore ran; then the
// whole projector waited a lag refresh after each batch that held one,
// for good where the end never came back (a backup without ends), so the
// other partitions crawled. Once the end is back, every record is written.
func TestClickHouseHeldPartitionWaits(t *testing.T) {
	k := ledgertest.New(t, ledgertest.Options{Partitions: 2})
	ev := k.Topics.Events
	live := freshStore(t)
	sink := &countingSink{Store: live}
	adm := admin(t, k)
	group := k.Group("held")
	onPartition := func(recs []*kgo.Record, partition int32) []*kgo.Record {
		for _, r := range recs {
			r.Partition = partition
		}
		return recs
	}
	produce(t, k, eventRecords(t, ev, ids("h", 20))...)
	produce(t, k, onPartition(eventRecords(t, ev, ids("o", 20)), 1)...)
	p, _ := start(t, k, group, sink, func(c *Config) { c.LagRefresh, c.MaxWait, c.MaxBatch = time.Second, 20*time.Millisecond, 10 })
	waitCaughtUp(t, adm, k, group)
	ends, err := live.Positions(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	end, _ := ends.Lookup(ev, 0)

	// The restore takes partition 0's end away.
	chtest.Exec(t, chtest.DSN(t), "TRUNCATE TABLE `"+live.Database()+"`.`projection_positions`")
	var others []projections.End
	for topic, ps := range ends {
		for partition, next := range ps {
			if topic != ev || partition != 0 {
				others = append(others, projections.End{Topic: topic, Partition: partition, Next: next})
			}
		}
	}
	if err := live.RecordEnds(t.Context(), others); err != nil {
		t.Fatal(err)
	}
	produce(t, k, eventRecords(t, ev, ids("g", 20))...)
	ledgertest.WaitFor(t, 10*time.Second, func() error {
		if held := p.Lag().Held; held != 1 {
			return fmt.Errorf("%d partitions held; want partition 0", held)
		}
		return nil
	})
	before := sink.reads.Load()
	// Partition 1 goes on, in batches of 10, while 0 is held.
	produce(t, k, onPartition(eventRecords(t, ev, ids("p", 200)), 1)...)
	ledgertest.WaitFor(t, 10*time.Second, func() error {
		if got := committed(t, adm, group)[ev][1]; got != 220 {
			return fmt.Errorf("partition 1 committed at %d while partition 0 is held; want 220", got)
		}
		return nil
	})
	time.Sleep(2 * time.Second)
	// About one a batch of partition 1 and one a lag refresh.
	if n := sink.reads.Load() - before; n > 60 {
		t.Errorf("%d reads of the ends while partition 0 was held; want one a batch of partition 1 (20) and one a lag refresh (1 s)", n)
	}
	if got := committed(t, adm, group)[ev][0]; got != end {
		t.Errorf("committed %d while the end is gone; want the group held at %d", got, end)
	}

	if err := live.RecordEnds(t.Context(), []projections.End{{Topic: ev, Partition: 0, Next: end}}); err != nil {
		t.Fatal(err)
	}
	waitCaughtUp(t, adm, k, group)
	if rows, err := live.EventRows(t.Context()); err != nil || rows < 260 {
		t.Errorf("events rows %d, %v; want the 260 produced", rows, err)
	}
	if held := p.Lag().Held; held != 0 {
		t.Errorf("%d partitions held once the end is back; want none", held)
	}
}

// endsSink is a Positioned sink whose ends are pos; onRead, if set, runs
// as they are read.
type endsSink struct {
	recSink
	pos    projections.Positions
	onRead func()
}

func (s *endsSink) Positions(context.Context) (projections.Positions, error) {
	if s.onRead != nil {
		s.onRead()
	}
	return s.pos, nil
}

// unconnected is a projector of no Kafka (its methods are called
// directly) over an endsSink whose events topic's partition 0 ends at
// end.
func unconnected(t *testing.T, end int64) (*Projector, *endsSink, string) {
	t.Helper()
	sink := &endsSink{pos: projections.Positions{}}
	p, err := New(Config{Client: ledger.ClientConfig{Brokers: []string{"127.0.0.1:1"}}}, sink)
	if err != nil {
		t.Fatal(err)
	}
	ev := p.cfg.Topics.Events
	sink.pos.Set(ev, 0, end)
	return p, sink, ev
}

// A lag refresh whose read of the ends raced the reread an earlier one
// found (applied between polls, moving where the group is to the
// projection's end) does not find the partition lacking again: before, it
// read the partition twice, counted twice (as a walk through a restore
// saw, once in two). And a reread found ends the poll in progress: before,
// it waited for the poll to time out, a lag refresh more.
func TestCheckCommittedSkipsAReadStaleByAReread(t *testing.T) {
	p, sink, ev := unconnected(t, 12)
	st := p.state(topicPartition{ev, 0})
	st.owned, st.learned, st.marked, st.endSeen, st.start, st.committed = true, true, true, true, 0, 30
	sink.onRead = func() {
		// applyRereads, of the first finding, as the ends are read.
		p.mu.Lock()
		st.next, st.committed = 12, 12
		p.mu.Unlock()
	}
	p.checkCommitted(t.Context(), nil, kadm.NewClient(nil))
	if m := p.Metrics(); m.Rereads != 0 || st.reread >= 0 {
		t.Errorf("rereads %d, reread at %d after a stale read; want none", m.Rereads, st.reread)
	}

	// Found lacking by a read not stale, the partition is read again,
	// and the poll in progress is ended so that it is at once: with no
	// records coming, the poll would wait a lag refresh.
	sink.onRead = nil
	st.committed = 30
	interrupted := false
	p.interrupt = func() { interrupted = true }
	p.checkCommitted(t.Context(), nil, kadm.NewClient(nil))
	if m := p.Metrics(); m.Rereads != 1 || st.reread != 12 || !interrupted {
		t.Errorf("rereads %d, reread at %d, poll ended %v; want the partition read again from 12 at once", m.Rereads, st.reread, interrupted)
	}
}

// A partition revoked while a flush reads the projection's ends is taken
// out of the batch, its rows and its end, and out of the commit: its next
// owner reads it again from the group's offset, having read the ends
// itself. Before, it was written as it was: its end, written into tables
// a restore was refilling, outlasted the restore's and hid what the
// restored database lacked.
func TestCheckPositionsDropsRevokedPartitions(t *testing.T) {
	p, sink, ev := unconnected(t, 10)
	kept, revoked := topicPartition{ev, 0}, topicPartition{ev, 1}
	b := newPendingBatch()
	var batch projections.Batch
	gens := make(map[topicPartition]uint64)
	for _, tp := range []topicPartition{kept, revoked} {
		st := p.state(tp)
		st.owned, st.learned, st.endSeen, st.start, st.committed, st.next = true, true, true, 0, 10, 12
		gens[tp] = st.gen
		b.add(&readPart{tp: tp, from: 10, next: kgo.EpochOffset{Offset: 12}, records: 2})
		batch.Events = append(batch.Events, projections.Event{Partition: tp.partition, Offset: 10}, projections.Event{Partition: tp.partition, Offset: 11})
	}
	batch.Ends = ends(b.next)
	// Revoked while the flush read the ends (a rebalance: another
	// projector joined), the restore having taken its end away.
	p.revoked(t.Context(), nil, map[string][]int32{ev: {1}})

	out, err := p.checkPositions(t.Context(), nil, sink, batch, b, gens)
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range out.Events {
		if e.Partition != 0 {
			t.Errorf("event of partition %d at %d in the batch written; want only partition 0's", e.Partition, e.Offset)
		}
	}
	if len(out.Events) != 2 {
		t.Errorf("%d events in the batch written; want partition 0's 2", len(out.Events))
	}
	if want := []projections.End{{Topic: ev, Partition: 0, Next: 12}}; !slices.Equal(out.Ends, want) {
		t.Errorf("ends written %v; want %v", out.Ends, want)
	}
	if _, ok := b.next[revoked]; ok {
		t.Errorf("the revoked partition is in the batch's commit: %v", b.next)
	}
}

// A partition the lag refresh found lacking records (its reread set) and a
// flush then finds lacking too is taken out of the batch, and counted and
// logged once: before, a flush racing the refresh counted it twice.
func TestCheckPositionsCountsARereadOnce(t *testing.T) {
	p, sink, ev := unconnected(t, 12)
	tp := topicPartition{ev, 0}
	st := p.state(tp)
	st.owned, st.learned, st.endSeen, st.start, st.committed, st.next = true, true, true, 0, 30, 32
	st.reread = 12 // the lag refresh's finding, not applied yet
	b := newPendingBatch()
	b.add(&readPart{tp: tp, from: 30, next: kgo.EpochOffset{Offset: 32}, records: 2})
	batch := projections.Batch{Events: []projections.Event{{Partition: 0, Offset: 30}, {Partition: 0, Offset: 31}}, Ends: ends(b.next)}
	out, err := p.checkPositions(t.Context(), nil, sink, batch, b, map[topicPartition]uint64{tp: st.gen})
	if err != nil {
		t.Fatal(err)
	}
	if out.Len() != 0 || len(out.Ends) != 0 || len(b.next) != 0 {
		t.Errorf("batch written %+v, committed %v; want the lacking partition out of both", out, b.next)
	}
	if m := p.Metrics(); m.Rereads != 0 || st.reread != 12 {
		t.Errorf("rereads %d, reread at %d; want the refresh's finding, counted by it alone", m.Rereads, st.reread)
	}
}

// A group committed with ends at the log start (a dev ledger run before
// any call) behind a new database (the developer dropped the old one) is
// not held: the log has nothing before the group's offset that the
// database could lack. Before, every partition was held for good, with a
// warning about a restore.
func TestClickHouseNewDatabaseAtTheLogStart(t *testing.T) {
	k := ledgertest.New(t, ledgertest.Options{Partitions: 2})
	ev := k.Topics.Events
	adm := admin(t, k)
	group := k.Group("new-db")
	mod := func(c *Config) { c.LagRefresh, c.MaxWait = 100*time.Millisecond, 20*time.Millisecond }
	_, stop := start(t, k, group, freshStore(t), mod)
	waitEndsMarked(t, adm, k, group)
	stop()

	fresh := freshStore(t)
	p, _ := start(t, k, group, fresh, mod)
	produce(t, k, eventRecords(t, ev, ids("n", 10))...)
	waitCaughtUp(t, adm, k, group)
	if rows, err := fresh.EventRows(t.Context()); err != nil || rows != 10 {
		t.Errorf("events rows %d, %v; want the 10 produced", rows, err)
	}
	if held := p.Lag().Held; held != 0 {
		t.Errorf("%d partitions held; want none", held)
	}
}

// failListOffsets, a ControlKey function while failing holds, answers
// every listing of offsets with a server error for each partition, as
// brokers do for a partition without a leader.
func failListOffsets(c *kfake.Cluster, failing *atomic.Bool) func(kmsg.Request) (kmsg.Response, error, bool) {
	return func(kreq kmsg.Request) (kmsg.Response, error, bool) {
		c.KeepControl()
		if !failing.Load() {
			return nil, nil, false
		}
		return ledgertest.AnswerListOffsets(kreq, func(_ kmsg.ListOffsetsRequestTopicPartition, sp *kmsg.ListOffsetsResponseTopicPartition) bool {
			sp.ErrorCode = kerr.UnknownServerError.Code
			return true
		})
	}
}

// A partition whose records retention deleted after they were projected,
// its end gone in a restore, stays held though no record comes: counted
// by the gauge, its end not recorded again, and compared at every lag
// refresh even while listing the log's offsets fails. When the restore
// brings back an end before the log start, the projector stops
// (ErrRecordsDeleted), as for any records deleted before they were
// projected. Before, the lag refresh recorded an end where the group was
// (the log had nothing left before it), which outlasted the restore's and
// hid the loss; the gauge counted only partitions a batch had paused; and
// a failed listing skipped the comparison.
func TestClickHouseEmptiedPartitionStaysHeld(t *testing.T) {
	c, k := deletedLog(t, "eh", "e", 10)
	ev := k.Topics.Events
	adm := admin(t, k)
	group := k.Group("emptied-held")
	if err := CommitOffsets(t.Context(), k.Client, group, map[string]map[int32]int64{ev: {0: 10}}); err != nil {
		t.Fatal(err)
	}
	live := freshStore(t)
	if err := live.RecordEnds(t.Context(), []projections.End{{Topic: ev, Partition: 0, Next: 10}}); err != nil {
		t.Fatal(err)
	}
	var failing atomic.Bool
	c.ControlKey(int16(kmsg.ListOffsets), failListOffsets(c, &failing))
	p := newProjector(t, k, group, live, func(c *Config) { c.LagRefresh = 100 * time.Millisecond })
	ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- p.Run(ctx) }()
	waitEndsMarked(t, adm, k, group)

	failing.Store(true)
	chtest.Exec(t, chtest.DSN(t), "TRUNCATE TABLE `"+live.Database()+"`.`projection_positions`")
	ledgertest.WaitFor(t, 10*time.Second, func() error {
		if held := p.Lag().Held; held != 1 {
			return fmt.Errorf("%d partitions held; want the emptied one", held)
		}
		return nil
	})
	time.Sleep(500 * time.Millisecond)
	if pos, err := live.Positions(t.Context()); err != nil {
		t.Fatal(err)
	} else if end, ok := pos.Lookup(ev, 0); ok {
		t.Errorf("the emptied partition's end recorded again at %d while the restore runs; want none", end)
	}

	failing.Store(false)
	if err := live.RecordEnds(t.Context(), []projections.End{{Topic: ev, Partition: 0, Next: 4}}); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-done:
		if !errors.Is(err, ErrRecordsDeleted) {
			t.Errorf("Run over a restore ending at 4 of a partition emptied up to 10 = %v; want ErrRecordsDeleted", err)
		}
	case <-ctx.Done():
		t.Error("the projector went on past records deleted before the restored projection held them")
	}
}

// A database restored while the projector was stopped, lacking records of
// a partition no record comes to, is read again as soon as the projector
// is assigned the partition, not at its first lag refresh (here an hour;
// 5 s by default, which a walk through a restore waited).
func TestClickHouseRestoreFoundAtAssignment(t *testing.T) {
	k := ledgertest.New(t, ledgertest.Options{Partitions: 1})
	ev := k.Topics.Events
	group := k.Group("found-at-assignment")
	produce(t, k, eventRecords(t, ev, ids("a", 10))...)
	if err := CommitOffsets(t.Context(), k.Client, group, map[string]map[int32]int64{ev: {0: 10}}); err != nil {
		t.Fatal(err)
	}
	live := freshStore(t)
	if err := live.RecordEnds(t.Context(), []projections.End{{Topic: ev, Partition: 0, Next: 4}}); err != nil {
		t.Fatal(err)
	}
	start(t, k, group, live, func(c *Config) { c.LagRefresh = time.Hour })
	ledgertest.WaitFor(t, 30*time.Second, func() error {
		if rows, err := live.EventRows(t.Context()); err != nil || rows != 6 {
			return fmt.Errorf("events rows %d, %v; want the 6 records from the restored end on", rows, err)
		}
		return nil
	})
}

// refuseCommits, a ControlKey function while refusing holds, answers every
// offset commit with a server error for each partition.
func refuseCommits(c *kfake.Cluster, refusing *atomic.Bool) func(kmsg.Request) (kmsg.Response, error, bool) {
	return func(kreq kmsg.Request) (kmsg.Response, error, bool) {
		c.KeepControl()
		if !refusing.Load() {
			return nil, nil, false
		}
		req := kreq.(*kmsg.OffsetCommitRequest)
		resp := req.ResponseKind().(*kmsg.OffsetCommitResponse)
		resp.Version = req.Version
		for _, rt := range req.Topics {
			st := kmsg.NewOffsetCommitResponseTopic()
			st.Topic = rt.Topic
			for _, rp := range rt.Partitions {
				sp := kmsg.NewOffsetCommitResponseTopicPartition()
				sp.Partition, sp.ErrorCode = rp.Partition, kerr.UnknownServerError.Code
				st.Partitions = append(st.Partitions, sp)
			}
			resp.Topics = append(resp.Topics, st)
		}
		return resp, nil, true
	}
}

// A partition held before its group's offset could say the projection had
// an end there (committed from outside, as rebuild --swap leaves it, the
// mark's commit refused meanwhile) is marked while held, so that its next
// owner holds it too. Before, held partitions were never marked: the next
// owner, a restart or a rebalance away, recorded an end where the group
// was and wrote what came. The next owner learns where the group is from
// the group's offsets, while listing the log's offsets fails (a partition
// without a leader): before, it compared nothing until a listing
// succeeded, and held nothing.
func TestClickHouseHeldPartitionMarkedForItsNextOwner(t *testing.T) {
	k := ledgertest.New(t, ledgertest.Options{Partitions: 1})
	ev := k.Topics.Events
	adm := admin(t, k)
	group := k.Group("held-marked")
	produce(t, k, eventRecords(t, ev, ids("m", 10))...)
	if err := CommitOffsets(t.Context(), k.Client, group, map[string]map[int32]int64{ev: {0: 10}}); err != nil {
		t.Fatal(err)
	}
	live := freshStore(t)
	if err := live.RecordEnds(t.Context(), []projections.End{{Topic: ev, Partition: 0, Next: 10}}); err != nil {
		t.Fatal(err)
	}
	var refusing, failing atomic.Bool
	refusing.Store(true)
	k.Cluster.ControlKey(int16(kmsg.OffsetCommit), refuseCommits(k.Cluster, &refusing))
	k.Cluster.ControlKey(int16(kmsg.ListOffsets), failListOffsets(k.Cluster, &failing))
	mod := func(c *Config) { c.LagRefresh, c.MaxWait = 100*time.Millisecond, 20*time.Millisecond }
	p, stop := start(t, k, group, live, mod)
	ledgertest.WaitFor(t, 10*time.Second, func() error {
		if m := p.Metrics(); m.CommitErrors == 0 {
			return errors.New("no commit of the mark refused yet")
		}
		return nil
	})
	// A restore takes the end away before the mark is committed.
	chtest.Exec(t, chtest.DSN(t), "TRUNCATE TABLE `"+live.Database()+"`.`projection_positions`")
	ledgertest.WaitFor(t, 10*time.Second, func() error {
		if held := p.Lag().Held; held != 1 {
			return fmt.Errorf("%d partitions held; want the events partition", held)
		}
		return nil
	})
	refusing.Store(false)
	waitEndsMarked(t, adm, k, group)
	stop()

	failing.Store(true)
	p, _ = start(t, k, group, live, mod)
	// Held with no record coming (the lag refresh's doing), and then
	// with records.
	ledgertest.WaitFor(t, 10*time.Second, func() error {
		if held := p.Lag().Held; held != 1 {
			return fmt.Errorf("%d partitions held by the next owner; want the events partition", held)
		}
		return nil
	})
	produce(t, k, eventRecords(t, ev, ids("n", 10))...)
	time.Sleep(500 * time.Millisecond)
	if held := p.Lag().Held; held != 1 {
		t.Errorf("%d partitions held once records came; want the events partition", held)
	}
	if got := committed(t, adm, group)[ev][0]; got != 10 {
		t.Errorf("committed %d while the end is gone; want the group held at 10", got)
	}
	if pos, err := live.Positions(t.Context()); err != nil {
		t.Fatal(err)
	} else if end, ok := pos.Lookup(ev, 0); ok {
		t.Errorf("the held partition's end recorded at %d by its next owner; want none", end)
	}
}

// A partition checkPositions held, whose end the lag refresh saw back
// before applyRereads ran, is read again from the batch's start and not
// paused: before, it was paused all the same, and resumed only after the
// next poll timed out, a lag refresh later.
func TestApplyRereadsPausesNoPartitionWhoseEndIsBack(t *testing.T) {
	p, _, ev := unconnected(t, 0)
	cl, err := kgo.NewClient(kgo.SeedBrokers("127.0.0.1:1"))
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	st := p.state(topicPartition{ev, 0})
	st.owned, st.learned, st.endSeen, st.start, st.committed, st.next = true, true, true, 0, 30, 32
	st.reread, st.hold = 30, true // held by checkPositions
	st.endGone = false            // and its end seen back since
	p.applyRereads(cl)
	if paused := cl.PauseFetchPartitions(nil); st.paused || len(paused) != 0 {
		t.Errorf("paused %v (%v) with its end back; want it read again, not paused", st.paused, paused)
	}
	if st.next != 30 || st.reread != -1 {
		t.Errorf("next %d, reread %d; want read again from 30", st.next, st.reread)
	}
}
