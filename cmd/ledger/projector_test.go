package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/toolcall-ledger/ledger/ledger"
	"github.com/toolcall-ledger/ledger/ledger/ledgertest"
	"github.com/toolcall-ledger/ledger/projections"
	"github.com/toolcall-ledger/ledger/projections/chstore"
	"github.com/toolcall-ledger/ledger/projections/chstore/chtest"
	"github.com/toolcall-ledger/ledger/projections/projector"
	"github.com/toolcall-ledger/ledger/statemachine"
)

// TestProjectorSkipDeleted: `ledger projector skip-deleted` moves a
// stopped projector's group past records the log deleted before they were
// projected (where the projector stops, ErrRecordsDeleted), and only
// there; and so where the projection's records end (a database restored
// from a backup older than the log), which the projector would otherwise
// go back to.
func TestProjectorSkipDeleted(t *testing.T) {
	k := ledgertest.New(t, ledgertest.Options{Partitions: 2})
	group := k.Group("skip-deleted")
	ev := k.Topics.Events
	adm := produceAcross(t, k)
	// Partition 0 committed at 1, then lost everything before 3; partition
	// 1 committed at 4, past what was lost (before 2).
	if err := projector.CommitOffsets(t.Context(), k.Client, group, map[string]map[int32]int64{ev: {0: 1, 1: 4}}); err != nil {
		t.Fatal(err)
	}
	deleteBefore(t, adm, ev, map[int32]int64{0: 3, 1: 2})
	// The projection ends where the group is.
	st, dsn, db := freshProjection(t)
	if err := st.RecordEnds(t.Context(), []projections.End{{Topic: ev, Partition: 0, Next: 1}, {Topic: ev, Partition: 1, Next: 4}}); err != nil {
		t.Fatal(err)
	}

	flags := []string{"--kafka-brokers", strings.Join(k.Client.Brokers, ","), "--topic-events", ev, "--topic-control", k.Topics.Control, "--group", group, "--clickhouse-dsn", dsn, "--clickhouse-database", db}
	out := cli(t, append([]string{"projector", "skip-deleted"}, flags...)...)
	for _, want := range []string{
		ev + "/0: offsets 1 to 2 were deleted before they were projected; the group goes on from 3",
		ev + "/0: the projection's records end at 1, and offsets 1 to 2 were deleted from the log; it goes on from 3",
	} {
		if !strings.Contains(out, want) || strings.Contains(out, ev+"/1") {
			t.Errorf("skip-deleted said:\n%s\nwant %q, and nothing of partition 1", out, want)
		}
	}
	pos, err := st.Positions(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	if diff := cmp.Diff(projections.Positions{ev: {0: 3, 1: 4}}, pos); diff != "" {
		t.Errorf("the projection's ends after skip-deleted (-want +got):\n%s", diff)
	}
	got, err := adm.FetchOffsets(t.Context(), group)
	if err != nil {
		t.Fatal(err)
	}
	for partition, want := range map[int32]int64{0: 3, 1: 4} {
		if o, _ := got.Lookup(ev, partition); o.At != want {
			t.Errorf("committed offset of %s/%d = %d; want %d", ev, partition, o.At, want)
		}
	}
	if out := cli(t, append([]string{"projector", "skip-deleted"}, flags...)...); !strings.Contains(out, "nothing to skip") {
		t.Errorf("skip-deleted again said:\n%s\nwant nothing to skip", out)
	}
}

// skip-deleted refused by the broker (a projector of the group runs) says
// nothing of the group going on: before, it said so for each partition,
// then failed.
func TestProjectorSkipDeletedSaysNothingWhenRefused(t *testing.T) {
	k := ledgertest.New(t, ledgertest.Options{Partitions: 2})
	group := k.Group("skip-deleted-refused")
	ev := k.Topics.Events
	adm := produceAcross(t, k)
	if err := projector.CommitOffsets(t.Context(), k.Client, group, map[string]map[int32]int64{ev: {0: 1, 1: 1}}); err != nil {
		t.Fatal(err)
	}
	deleteBefore(t, adm, ev, map[int32]int64{0: 3})
	joined := make(chan struct{})
	var once sync.Once
	member, err := ledger.NewClient(k.Client, kgo.ConsumerGroup(group), kgo.ConsumeTopics(ev),
		kgo.OnPartitionsAssigned(func(context.Context, *kgo.Client, map[string][]int32) { once.Do(func() { close(joined) }) }))
	if err != nil {
		t.Fatal(err)
	}
	defer member.Close()
	select {
	case <-joined:
	case <-time.After(15 * time.Second):
		t.Fatal("test setup: the member never joined")
	}
	_, dsn, db := freshProjection(t)
	out, err := cliOut(t.Context(), "projector", "skip-deleted", "--kafka-brokers", strings.Join(k.Client.Brokers, ","),
		"--topic-events", ev, "--topic-control", k.Topics.Control, "--group", group, "--clickhouse-dsn", dsn, "--clickhouse-database", db)
	if !errors.Is(err, projector.ErrGroupActive) || strings.Contains(out, "goes on") {
		t.Errorf("skip-deleted with a projector running: %v, said:\n%s\nwant ErrGroupActive, and nothing of the group going on", err, out)
	}
}

// produceAcross produces ten requested events to k's events topic of two
// partitions, offsets 0 to 4 on each, and returns an admin client of k.
func produceAcross(t *testing.T, k *ledgertest.Kafka) *kadm.Client {
	t.Helper()
	cl, err := ledger.NewClient(k.Client, kgo.RecordPartitioner(kgo.ManualPartitioner()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(cl.Close)
	var recs []*kgo.Record
	for i := range 10 {
		e := ledger.Event{EventID: fmt.Sprintf("e-%d", i), Type: statemachine.EventRequested, Seq: 1, At: time.Now().UTC(),
			TenantID: "t_a", IdempotencyKey: fmt.Sprintf("k-%d", i), Tool: "refund_order"}
		r, err := e.Record(k.Topics.Events)
		if err != nil {
			t.Fatal(err)
		}
		r.Partition = int32(i % 2)
		recs = append(recs, r)
	}
	if err := cl.ProduceSync(t.Context(), recs...).FirstErr(); err != nil {
		t.Fatal(err)
	}
	return kadm.NewClient(cl)
}

// deleteBefore deletes topic's records before the offsets given, by
// partition, as retention does.
func deleteBefore(t *testing.T, adm *kadm.Client, topic string, before map[int32]int64) {
	t.Helper()
	offsets := kadm.Offsets{topic: {}}
	for p, at := range before {
		offsets[topic][p] = kadm.Offset{Topic: topic, Partition: p, At: at, LeaderEpoch: -1}
	}
	resps, err := adm.DeleteRecords(t.Context(), offsets)
	if err == nil {
		err = resps.Error()
	}
	if err != nil {
		t.Fatalf("delete records: %v", err)
	}
}

// freshProjection is a migrated ClickHouse database of its own, its store,
// DSN and name.
func freshProjection(t *testing.T) (*chstore.Store, string, string) {
	t.Helper()
	dsn, db := chtest.DSN(t), chtest.FreshDatabase(t)
	st, err := chstore.Open(t.Context(), chstore.Config{DSN: dsn, Database: db})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { st.Close() })
	if err := st.Migrate(t.Context()); err != nil {
		t.Fatal(err)
	}
	return st, dsn, db
}

// projectOneEvent writes a requested event into st, as a projector that
// began would have.
func projectOneEvent(t *testing.T, st *chstore.Store) {
	t.Helper()
	e := ledger.Event{V: 1, EventID: "e-0", Type: statemachine.EventRequested, Seq: 1, At: time.Now().UTC(), TenantID: "t_a", IdempotencyKey: "k-0", Tool: "refund_order"}
	if err := st.Write(t.Context(), projections.Batch{Events: []projections.Event{{Event: e}}}); err != nil {
		t.Fatal(err)
	}
}

// A projector whose group lost its offsets (expired while it was down
// longer than Kafka keeps an empty group's, or deleted) while the log
// deleted records meanwhile is refused at its start, where it went on
// from the log's start without a word; skip-deleted moves it on there,
// said aloud. A partition whose log still starts at 0 loses nothing.
func TestProjectorWithLostOffsetsIsRefused(t *testing.T) {
	k := ledgertest.New(t, ledgertest.Options{Partitions: 2})
	group := k.Group("lost-offsets")
	ev := k.Topics.Events
	adm := produceAcross(t, k)
	deleteBefore(t, adm, ev, map[int32]int64{0: 3})
	st, dsn, db := freshProjection(t)
	projectOneEvent(t, st)
	kafkaFlags := []string{"--kafka-brokers", strings.Join(k.Client.Brokers, ","), "--topic-events", ev, "--topic-control", k.Topics.Control, "--group", group}
	run := append([]string{"projector", "--clickhouse-dsn", dsn, "--clickhouse-database", db, "--metrics-addr", ""}, kafkaFlags...)
	if err := cliErr(t, run...); err == nil || !strings.Contains(err.Error(), "no committed offset on "+ev+"/0 (the log starts at 3)") || strings.Contains(err.Error(), ev+"/1") {
		t.Fatalf("projector with lost offsets: %v; want refused, naming %s/0 alone", err, ev)
	}
	out := cli(t, append([]string{"projector", "skip-deleted", "--clickhouse-dsn", dsn, "--clickhouse-database", db}, kafkaFlags...)...)
	if want := ev + "/0: no committed offset (expired or deleted), and offsets before 3 were deleted; the group goes on from 3"; !strings.Contains(out, want) || strings.Contains(out, ev+"/1") {
		t.Errorf("skip-deleted said:\n%s\nwant %q, and nothing of partition 1", out, want)
	}
	if lost, err := startOffsets(t.Context(), st, k.Client, k.Topics, group); err != nil || len(lost) != 0 {
		t.Errorf("lost offsets after skip-deleted: %v, %v; want none", lost, err)
	}
}

// A partition the projector never committed for a harmless reason (empty
// since before the projection began, or a first catch-up stopped early) is
// no loss: the first start commits the log's start on every partition
// without an offset, and a restart over the projection it began is not
// refused. A group with members is not checked: Kafka keeps a live
// group's offsets.
func TestProjectorStartCommitsUnstartedPartitions(t *testing.T) {
	k := ledgertest.New(t, ledgertest.Options{Partitions: 2})
	group := k.Group("unstarted")
	ev := k.Topics.Events
	adm := produceAcross(t, k)
	deleteBefore(t, adm, ev, map[int32]int64{1: 5}) // partition 1: empty, its log at 5
	st, _, _ := freshProjection(t)
	if lost, err := startOffsets(t.Context(), st, k.Client, k.Topics, group); err != nil || len(lost) != 0 {
		t.Fatalf("first start: lost %v, %v; want none", lost, err)
	}
	got, err := adm.FetchOffsets(t.Context(), group)
	if err != nil {
		t.Fatal(err)
	}
	for partition, want := range map[int32]int64{0: 0, 1: 5} {
		if o, ok := got.Lookup(ev, partition); !ok || o.At != want {
			t.Errorf("first start committed %s/%d at %d (%v); want %d", ev, partition, o.At, ok, want)
		}
	}
	// The projection began (partition 0's first event), and stopped
	// before partition 1 ever had records to commit: no loss.
	projectOneEvent(t, st)
	if lost, err := startOffsets(t.Context(), st, k.Client, k.Topics, group); err != nil || len(lost) != 0 {
		t.Errorf("restart: lost %v, %v; want none", lost, err)
	}

	// Another group, its offsets gone: refused while it has no member,
	// left alone while one runs.
	other := k.Group("live")
	member, err := ledger.NewClient(k.Client, kgo.ConsumerGroup(other), kgo.ConsumeTopics(ev))
	if err != nil {
		t.Fatal(err)
	}
	defer member.Close()
	ledgertest.WaitFor(t, 20*time.Second, func() error {
		member.PollFetches(t.Context())
		s, err := projector.Status(t.Context(), projector.StatusConfig{Client: k.Client, Topics: k.Topics, Group: other})
		if s.Members == 0 {
			return fmt.Errorf("group %s has no member yet (%v)", other, err)
		}
		return nil
	})
	if lost, err := startOffsets(t.Context(), st, k.Client, k.Topics, other); err != nil || len(lost) != 0 {
		t.Errorf("a live group: lost %v, %v; want it left alone", lost, err)
	}
}

// produceOneEvent produces a requested event to k's events topic, and
// more records.
// freshStore is a migrated store in a database of its own.
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

func produceOneEvent(t *testing.T, k *ledgertest.Kafka, more ...*kgo.Record) {
	t.Helper()
	e := ledger.Event{EventID: "e-1", Type: statemachine.EventRequested, Seq: 1, At: time.Now().UTC(),
		TenantID: "t_a", IdempotencyKey: "k-1", Tool: "refund_order"}
	er, err := e.Record(k.Topics.Events)
	if err != nil {
		t.Fatal(err)
	}
	cl, err := ledger.NewClient(k.Client)
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	if err := cl.ProduceSync(t.Context(), append([]*kgo.Record{er}, more...)...).FirstErr(); err != nil {
		t.Fatal(err)
	}
}

// A database behind the group is missing a topic's records when it holds
// nothing of that topic while the group has committed offsets on it past
// the log's start; a control action projected before the first event (a
// freeze before any call) is no gap in the events.
func TestProjectionGapPerTopic(t *testing.T) {
	k := ledgertest.New(t, ledgertest.Options{Partitions: 1})
	group := k.Group("gap")
	ctx := t.Context()
	freeze := ledger.ControlAction{V: 1, Kind: "freeze", Subject: "tool:refund_order", Tool: "refund_order",
		By: "op", ByTenant: "*", Reason: "incident", At: time.Now().UTC()}
	value, err := json.Marshal(freeze)
	if err != nil {
		t.Fatal(err)
	}
	produceOneEvent(t, k, &kgo.Record{Topic: k.Topics.Control, Key: []byte(freeze.Subject), Value: value})
	st := freshStore(t)
	gap := func(want bool, when string) {
		t.Helper()
		if _, got, err := projectionGap(ctx, st, k.Client, k.Topics, group); err != nil || got != want {
			t.Errorf("%s: gap = %v, %v; want %v", when, got, err, want)
		}
	}
	commit := func(topic string) {
		t.Helper()
		if err := projector.CommitOffsets(ctx, k.Client, group, map[string]map[int32]int64{topic: {0: 1}}); err != nil {
			t.Fatal(err)
		}
	}
	gap(false, "a group that never committed")
	commit(k.Topics.Control)
	gap(true, "control committed, no control action projected")
	if err := st.Write(ctx, projections.Batch{Actions: []projections.Action{{Action: freeze}}}); err != nil {
		t.Fatal(err)
	}
	gap(false, "control committed and projected, no event yet")
	commit(k.Topics.Events)
	gap(true, "events committed, no event projected")

	// Events projected, and no control action: the projector commits past
	// control records it writes nothing for (a tombstone, one it cannot
	// read), so the control topic is the projection's all the same.
	st = freshStore(t)
	e := ledger.Event{EventID: "e-1", Type: statemachine.EventRequested, Seq: 1, At: time.Now().UTC(),
		TenantID: "t_a", IdempotencyKey: "k-1", Tool: "refund_order"}
	if err := st.Write(ctx, projections.Batch{Events: []projections.Event{{Event: e}}}); err != nil {
		t.Fatal(err)
	}
	gap(false, "events projected, control committed past records not written")
}

// A group committed past aborted writes alone (a fresh deployment whose
// first transactions aborted, the projector restarted before any
// committed event) is no gap: the log holds nothing to project below its
// offset. Before, the projector refused to start, and rebuild --swap,
// which found nothing either and committed the same offsets, did not mend
// it. A committed event below the offset is a gap again.
func TestProjectionGapNotOfAbortedWrites(t *testing.T) {
	k := ledgertest.New(t, ledgertest.Options{Partitions: 1})
	group := k.Group("gap-aborted")
	ctx := t.Context()
	st := freshStore(t)
	txn, err := ledger.NewClient(k.Client, kgo.TransactionalID("gap-aborted"))
	if err != nil {
		t.Fatal(err)
	}
	defer txn.Close()
	e := ledger.Event{EventID: "e-1", Type: statemachine.EventRequested, Seq: 1, At: time.Now().UTC(),
		TenantID: "t_a", IdempotencyKey: "k-1", Tool: "refund_order"}
	er, err := e.Record(k.Topics.Events)
	if err != nil {
		t.Fatal(err)
	}
	if err := txn.BeginTransaction(); err != nil {
		t.Fatal(err)
	}
	if err := txn.ProduceSync(ctx, er).FirstErr(); err != nil {
		t.Fatal(err)
	}
	if err := txn.EndTransaction(ctx, kgo.TryAbort); err != nil {
		t.Fatal(err)
	}
	// Past the aborted record and its marker, as a projector commits.
	end := func() int64 {
		t.Helper()
		s, err := projector.Status(ctx, projector.StatusConfig{Client: k.Client, Topics: k.Topics, Group: group})
		if err != nil && !errors.Is(err, projector.ErrNeverCommitted) {
			t.Fatal(err)
		}
		for _, p := range s.Partitions {
			if p.Topic == k.Topics.Events {
				return p.Stable
			}
		}
		t.Fatal("no events partition in the status")
		return 0
	}
	commitAt := func(offset int64) {
		t.Helper()
		if err := projector.CommitOffsets(ctx, k.Client, group, map[string]map[int32]int64{k.Topics.Events: {0: offset}}); err != nil {
			t.Fatal(err)
		}
	}
	aborted := end()
	if aborted < 2 {
		t.Fatalf("the events log ends at %d; want past an aborted record and its marker", aborted)
	}
	commitAt(aborted)
	if _, gap, err := projectionGap(ctx, st, k.Client, k.Topics, group); err != nil || gap {
		t.Errorf("committed past aborted writes alone: gap = %v, %v; want none", gap, err)
	}
	produceOneEvent(t, k)
	commitAt(end())
	if _, gap, err := projectionGap(ctx, st, k.Client, k.Topics, group); err != nil || !gap {
		t.Errorf("committed past a committed event not projected: gap = %v, %v; want one", gap, err)
	}
}

// A projector started while rebuild --swap replays the log (a restart in
// the hour a replay can take) writes into the live tables and commits
// offsets for them: the swap is refused, not made under it, which would
// drop what it wrote and leave its group past it.
func TestRebuildSwapRefusesAProjectorStartedDuringTheReplay(t *testing.T) {
	k := ledgertest.NewInProcess(t, ledgertest.Options{Partitions: 1}) // the hook is kfake's
	group := k.Group("swap")
	ctx := t.Context()
	produceOneEvent(t, k)
	dsn, db := chtest.DSN(t), chtest.FreshDatabase(t)
	t.Cleanup(func() { chtest.DropDatabase(t, dsn, db+"_rebuild") })
	cli(t, "projector", "migrate", "--clickhouse-dsn", dsn, "--clickhouse-database", db)
	live, err := chstore.Open(ctx, chstore.Config{DSN: dsn, Database: db})
	if err != nil {
		t.Fatal(err)
	}
	defer live.Close()

	// The first fetch (the check before the replay, or the replay) waits
	// until a member of the group has joined, and written an event of
	// the log past the replay's end (produced since) into the live
	// tables, as a projector does: one the rebuild lacks.
	joined := make(chan struct{})
	var (
		once   sync.Once
		hooked atomic.Bool
		member = make(chan *kgo.Client, 1)
	)
	defer func() {
		if hooked.Load() {
			if m := <-member; m != nil {
				m.Close()
			}
		}
	}()
	k.Cluster.ControlKey(int16(kmsg.Fetch), func(kmsg.Request) (kmsg.Response, error, bool) {
		if hooked.Swap(true) {
			return nil, nil, false
		}
		go func() {
			// A group client joins once made.
			m, err := ledger.NewClient(k.Client, kgo.ConsumerGroup(group), kgo.ConsumeTopics(k.Topics.Events),
				kgo.OnPartitionsAssigned(func(context.Context, *kgo.Client, map[string][]int32) { once.Do(func() { close(joined) }) }))
			if err != nil {
				t.Error(err)
			}
			member <- m
		}()
		k.Cluster.SleepControl(func() {
			select {
			case <-joined:
				e := ledger.Event{V: 1, EventID: "e-later", Type: statemachine.EventRequested, Seq: 1, At: time.Now().UTC(), TenantID: "t_a", IdempotencyKey: "k-later", Tool: "refund_order"}
				if err := live.Write(ctx, projections.Batch{Events: []projections.Event{{Event: e}}}); err != nil {
					t.Error(err)
				}
			case <-time.After(15 * time.Second):
			}
		})
		return nil, nil, false
	})

	err = cliErr(t, "projector", "rebuild", "--swap", "--kafka-brokers", strings.Join(k.Client.Brokers, ","),
		"--topic-events", k.Topics.Events, "--topic-control", k.Topics.Control, "--group", group,
		"--clickhouse-dsn", dsn, "--clickhouse-database", db)
	select {
	case <-joined:
	default:
		t.Fatal("test setup: the member never joined")
	}
	// Refused for the projector, not for what it wrote (blamed on the
	// log's retention before).
	if err == nil || !strings.Contains(err.Error(), "stop the projector") {
		t.Errorf("rebuild --swap with a projector started during the replay: %v; want it refused", err)
	}
	if n, err := live.EventRows(ctx); err != nil || n != 1 {
		t.Errorf("live events after the refused swap = %d, %v; want the live tables kept (1)", n, err)
	}
}

// rebuild --swap over a live database of an older schema version is
// refused before the replay, naming the database to migrate: before, it
// replayed the whole log, and the swap then blamed the rebuild.
func TestRebuildSwapRefusesAnOlderLiveSchemaFirst(t *testing.T) {
	k := ledgertest.New(t, ledgertest.Options{Partitions: 1})
	group := k.Group("swap-older")
	ctx := t.Context()
	produceOneEvent(t, k)
	dsn, db, into := chtest.DSN(t), chtest.FreshDatabase(t), chtest.FreshDatabase(t)
	cli(t, "projector", "migrate", "--clickhouse-dsn", dsn, "--clickhouse-database", db)
	older := chstore.LatestVersion() - 1
	chtest.Exec(t, dsn, fmt.Sprintf("ALTER TABLE `%s`.schema_migrations DELETE WHERE version > %d", db, older))
	live, err := chstore.Open(ctx, chstore.Config{DSN: dsn, Database: db})
	if err != nil {
		t.Fatal(err)
	}
	defer live.Close()
	ledgertest.WaitFor(t, 30*time.Second, func() error {
		if v, err := live.SchemaVersion(ctx); err != nil || v != older {
			return fmt.Errorf("schema version %d, %v; want %d", v, err, older)
		}
		return nil
	})

	err = cliErr(t, "projector", "rebuild", "--swap", "--into", into, "--kafka-brokers", strings.Join(k.Client.Brokers, ","),
		"--topic-events", k.Topics.Events, "--topic-control", k.Topics.Control, "--group", group,
		"--clickhouse-dsn", dsn, "--clickhouse-database", db)
	if err == nil || !strings.Contains(err.Error(), "migrate "+db) || !strings.Contains(err.Error(), "`ledger projector migrate`") {
		t.Errorf("rebuild --swap over schema version %d: %v; want it refused, saying to migrate %s", older, err, db)
	}
	rebuilt, err := chstore.Open(ctx, chstore.Config{DSN: dsn, Database: into})
	if err != nil {
		t.Fatal(err)
	}
	defer rebuilt.Close()
	if v, err := rebuilt.SchemaVersion(ctx); err != nil || v != 0 {
		t.Errorf("--into %s after the refusal: schema version %d, %v; want untouched (0), refused before the replay", into, v, err)
	}
}

// A migration that fills rows in from those projected (006: call_refs'
// call and trace ids, from the events) is refused while a projector of
// the group runs: one of the older build would go on writing events
// without those rows, for good. Once it stopped, migrate applies it.
func TestMigrateRefusesAFillWhileAProjectorRuns(t *testing.T) {
	k := ledgertest.New(t, ledgertest.Options{Partitions: 1})
	group := k.Group("fill")
	ctx := t.Context()
	produceOneEvent(t, k)
	dsn, db := chtest.DSN(t), chtest.FreshDatabase(t)
	migrate := []string{"projector", "migrate", "--kafka-brokers", strings.Join(k.Client.Brokers, ","),
		"--topic-events", k.Topics.Events, "--topic-control", k.Topics.Control, "--group", group,
		"--clickhouse-dsn", dsn, "--clickhouse-database", db}
	cli(t, migrate...)
	st, err := chstore.Open(ctx, chstore.Config{DSN: dsn, Database: db})
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	// The database as it was before 006.
	const fill = 6
	chtest.Exec(t, dsn, fmt.Sprintf("ALTER TABLE `%s`.schema_migrations DELETE WHERE version >= %d", db, fill))
	version := func() error {
		if v, err := st.SchemaVersion(ctx); err != nil || v != fill-1 {
			return fmt.Errorf("schema version %d, %v; want %d", v, err, fill-1)
		}
		return nil
	}
	ledgertest.WaitFor(t, 30*time.Second, version)

	joined := make(chan struct{})
	var once sync.Once
	member, err := ledger.NewClient(k.Client, kgo.ConsumerGroup(group), kgo.ConsumeTopics(k.Topics.Events),
		kgo.OnPartitionsAssigned(func(context.Context, *kgo.Client, map[string][]int32) { once.Do(func() { close(joined) }) }))
	if err != nil {
		t.Fatal(err)
	}
	go member.PollFetches(ctx)
	select {
	case <-joined:
	case <-time.After(15 * time.Second):
		t.Fatal("test setup: the member never joined")
	}
	if err := cliErr(t, migrate...); err == nil || !strings.Contains(err.Error(), "Stop the projector") {
		t.Errorf("migrate with a fill pending and a projector running: %v; want it refused", err)
	}
	if err := version(); err != nil {
		t.Errorf("after the refusal: %v", err)
	}
	member.Close()
	cli(t, migrate...)
	if v, err := st.SchemaVersion(ctx); err != nil || v != chstore.LatestVersion() {
		t.Errorf("schema version after migrate = %d, %v; want %d", v, err, chstore.LatestVersion())
	}
}

// A rebuild holding fewer control actions than the live tables, the same
// subjects (the control topic compacted a tool's freeze away, keeping its
// unfreeze), may be swapped in: before, every rebuild after a freeze and
// an unfreeze was refused, and --force, which lets a rebuild short of
// events through too, became routine. One lacking an event, or a
// subject, is refused, even when it holds as many or more (newer events
// the live projection had not written, a newer subject): the counts were
// compared before, and such a rebuild was swapped in, losing them.
func TestRebuildHoldsAll(t *testing.T) {
	at := time.Now().UTC().Truncate(time.Millisecond)
	freeze := ledger.ControlAction{V: 1, Kind: "freeze", Subject: "tool:refund_order", Tool: "refund_order", By: "u_ops", ByTenant: "*", Reason: "incident", At: at}
	unfreeze := ledger.ControlAction{V: 1, Kind: "unfreeze", Subject: "tool:refund_order", Tool: "refund_order", By: "u_ops", ByTenant: "*", Reason: "over", At: at.Add(time.Minute)}
	revoke := ledger.ControlAction{V: 1, Kind: "revoke", Subject: "jti:j1", JTI: "j1", By: "u_ops", ByTenant: "*", Reason: "leak", At: at}
	event := projections.Event{Event: ledger.Event{EventID: "e-1", Type: statemachine.EventRequested, Seq: 1, At: at,
		TenantID: "t_a", IdempotencyKey: "k-1", Tool: "refund_order"}}
	// newer is an event the live tables do not hold yet; lastMonth (40 days back) is
	// one they do, in another partition.
	newer, lastMonth := event, event
	newer.EventID, newer.IdempotencyKey = "e-2", "k-2"
	lastMonth.EventID, lastMonth.IdempotencyKey, lastMonth.At = "e-0", "k-0", at.AddDate(0, 0, -40)
	revokeNewer := revoke
	revokeNewer.Subject, revokeNewer.JTI = "jti:j2", "j2"
	write := func(st *chstore.Store, evs []projections.Event, as ...ledger.ControlAction) {
		t.Helper()
		b := projections.Batch{Events: evs}
		for i, a := range as {
			b.Actions = append(b.Actions, projections.Action{Action: a, Offset: int64(i)})
		}
		if err := st.Write(t.Context(), b); err != nil {
			t.Fatal(err)
		}
	}
	live := freshStore(t)
	write(live, []projections.Event{lastMonth, event}, freeze, unfreeze, revoke)
	for _, tc := range []struct {
		name    string
		evs     []projections.Event
		actions []ledger.ControlAction
		want    string
	}{
		{"compacted", []projections.Event{lastMonth, event}, []ledger.ControlAction{unfreeze, revoke}, ""},
		{"and newer", []projections.Event{lastMonth, event, newer}, []ledger.ControlAction{unfreeze, revoke, revokeNewer}, ""},
		{"short of events", nil, []ledger.ControlAction{unfreeze, revoke}, "lacks 2 of the events"},
		{"short of last month's event", []projections.Event{event}, []ledger.ControlAction{unfreeze, revoke}, "lacks 1 of the events"},
		{"as many events, one lost", []projections.Event{event, newer}, []ledger.ControlAction{unfreeze, revoke}, "lacks 1 of the events"},
		{"short of a subject", []projections.Event{lastMonth, event}, []ledger.ControlAction{unfreeze}, "control actions of 1 subjects"},
		{"as many subjects, one lost", []projections.Event{lastMonth, event}, []ledger.ControlAction{unfreeze, revokeNewer}, "control actions of 1 subjects"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			fresh := freshStore(t)
			write(fresh, tc.evs, tc.actions...)
			err := rebuildHoldsAll(t.Context(), live, fresh)
			if (err == nil) != (tc.want == "") || err != nil && !strings.Contains(err.Error(), tc.want) {
				t.Errorf("rebuildHoldsAll: %v; want %q", err, tc.want)
			}
		})
	}
}

// `ledger projector status --clickhouse-dsn` shows where the projection's
// records end beside the group's offsets, and says so when it holds less
// than the group committed (a database restored from an older backup).
func TestProjectorStatusShowsEnds(t *testing.T) {
	k := ledgertest.New(t, ledgertest.Options{Partitions: 2})
	group := k.Group("status-ends")
	ev := k.Topics.Events
	produceAcross(t, k)
	if err := projector.CommitOffsets(t.Context(), k.Client, group, map[string]map[int32]int64{ev: {0: 5, 1: 5}}); err != nil {
		t.Fatal(err)
	}
	st, dsn, db := freshProjection(t)
	if err := st.RecordEnds(t.Context(), []projections.End{{Topic: ev, Partition: 0, Next: 5}, {Topic: ev, Partition: 1, Next: 3}}); err != nil {
		t.Fatal(err)
	}
	flags := []string{"projector", "status", "--kafka-brokers", strings.Join(k.Client.Brokers, ","), "--topic-events", ev, "--topic-control", k.Topics.Control, "--group", group}
	if out := cli(t, flags...); strings.Contains(out, "PROJECTED") {
		t.Errorf("status without --clickhouse-dsn shows a PROJECTED column:\n%s", out)
	}
	out := cli(t, append(flags, "--clickhouse-dsn", dsn, "--clickhouse-database", db)...)
	if !strings.Contains(out, "PROJECTED") || !strings.Contains(out, "end before the group's offset on 1 partitions") {
		t.Errorf("status with --clickhouse-dsn:\n%s\nwant a PROJECTED column, and partition 1 named behind", out)
	}
	var s projector.GroupStatus
	if err := json.Unmarshal([]byte(cli(t, append(flags, "--clickhouse-dsn", dsn, "--clickhouse-database", db, "--json")...)), &s); err != nil {
		t.Fatal(err)
	}
	for _, p := range s.Partitions {
		want := map[int32]int64{0: 5, 1: 3}[p.Partition]
		if p.Topic == ev && (p.Projected == nil || *p.Projected != want) {
			t.Errorf("JSON %s/%d projected %v; want %d", p.Topic, p.Partition, p.Projected, want)
		}
	}
}

// TestProjectorRecordEnds: a database restored from a backup without ends
// (here: the ends truncated) behind a group a projector committed with
// them is counted by status as held, and `ledger projector record-ends`
// records each partition's end where the group is, after which status
// counts none and a second run has nothing to record.
func TestProjectorRecordEnds(t *testing.T) {
	k := ledgertest.New(t, ledgertest.Options{Partitions: 2})
	group := k.Group("record-ends")
	produceAcross(t, k)
	st, dsn, db := freshProjection(t)
	stop := runProjector(t, k, group, st)
	statusOf := func() (projector.GroupStatus, error) {
		return projector.Status(t.Context(), projector.StatusConfig{Client: k.Client, Topics: k.Topics, Group: group})
	}
	ledgertest.WaitFor(t, 30*time.Second, func() error {
		s, err := statusOf()
		if err != nil {
			return err
		}
		for _, p := range s.Partitions {
			if !p.Ended || p.Records > 0 {
				return fmt.Errorf("%s/%d: ended %v, lag %d; want every partition caught up and ended", p.Topic, p.Partition, p.Ended, p.Records)
			}
		}
		return nil
	})
	stop()
	s, err := statusOf()
	if err != nil {
		t.Fatal(err)
	}

	chtest.Exec(t, dsn, "TRUNCATE TABLE `"+db+"`.`projection_positions`")
	flags := []string{"--kafka-brokers", strings.Join(k.Client.Brokers, ","), "--topic-events", k.Topics.Events, "--topic-control", k.Topics.Control,
		"--group", group, "--clickhouse-dsn", dsn, "--clickhouse-database", db}
	// Held: the events topic's two partitions; the control topic's,
	// empty, get their ends again (nothing there for a restore to lack).
	held := fmt.Sprintf("no end of %d partitions the group committed with one", 2)
	if out := cli(t, append([]string{"projector", "status"}, flags...)...); !strings.Contains(out, held) {
		t.Errorf("status over the restored database:\n%s\nwant %q", out, held)
	}
	// A group that never committed (the wrong --group) is refused, not
	// taken to be at the log start.
	wrong := append(slices.Clone(flags), "--group", k.Group("record-ends-wrong"))
	if err := cliErr(t, append([]string{"projector", "record-ends"}, wrong...)...); err == nil || !strings.Contains(err.Error(), "has committed no offset") {
		t.Errorf("record-ends with a group that never committed: %v; want it refused", err)
	}
	out := cli(t, append([]string{"projector", "record-ends"}, flags...)...)
	pos, err := st.Positions(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range s.Partitions {
		if end, ok := pos.Lookup(p.Topic, p.Partition); !ok || end != p.Committed {
			t.Errorf("%s/%d: the projection's end %d (%v) after record-ends; want the group's %d\n%s", p.Topic, p.Partition, end, ok, p.Committed, out)
		}
	}
	if out := cli(t, append([]string{"projector", "status"}, flags...)...); strings.Contains(out, "no end of") {
		t.Errorf("status after record-ends:\n%s\nwant no partition held", out)
	}
	if out := cli(t, append([]string{"projector", "record-ends"}, flags...)...); !strings.Contains(out, "nothing to record") {
		t.Errorf("record-ends again:\n%s\nwant nothing to record", out)
	}

	// A backup of a schema version without ends: migrate first.
	older := chstore.LatestVersion() - 1
	chtest.Exec(t, dsn, fmt.Sprintf("ALTER TABLE `%s`.schema_migrations DELETE WHERE version > %d", db, older))
	ledgertest.WaitFor(t, 30*time.Second, func() error {
		if v, err := st.SchemaVersion(t.Context()); err != nil || v != older {
			return fmt.Errorf("schema version %d, %v; want %d", v, err, older)
		}
		return nil
	})
	if err := cliErr(t, append([]string{"projector", "record-ends"}, flags...)...); err == nil || !strings.Contains(err.Error(), "`ledger projector migrate`") {
		t.Errorf("record-ends over schema version %d: %v; want it refused, saying to migrate", older, err)
	}
}

// rebuild --swap drops the database it rebuilt into once the swap has
// emptied it, and leaves one that held more: before, every swap left an
// empty <database>_rebuild behind (a walk through the README found it).
func TestRebuildSwapDropsItsEmptiedDatabase(t *testing.T) {
	k := ledgertest.New(t, ledgertest.Options{Partitions: 2})
	produceAcross(t, k)
	databases := func(name string) uint64 {
		t.Helper()
		return chtest.Count(t, chtest.DSN(t), "SELECT count() FROM system.databases WHERE name = '"+name+"'")
	}
	for _, other := range []bool{false, true} {
		_, dsn, db := freshProjection(t)
		into := db + "_rebuild"
		t.Cleanup(func() { chtest.Exec(t, dsn, "DROP DATABASE IF EXISTS `"+into+"`") })
		if other {
			chtest.Exec(t, dsn, "CREATE DATABASE `"+into+"`")
			chtest.Exec(t, dsn, "CREATE TABLE `"+into+"`.notes (n UInt8) ENGINE = Memory")
		}
		out := cli(t, "projector", "rebuild", "--swap", "--kafka-brokers", strings.Join(k.Client.Brokers, ","),
			"--topic-events", k.Topics.Events, "--topic-control", k.Topics.Control, "--group", k.Group(fmt.Sprintf("swap-drops-%v", other)),
			"--clickhouse-dsn", dsn, "--clickhouse-database", db)
		if got, want := databases(into), map[bool]uint64{false: 0, true: 1}[other]; got != want || strings.Contains(out, "dropped database") == other {
			t.Errorf("--into holding another table: %v; %s databases after the swap: %d, want %d\n%s", other, into, got, want, out)
		}
	}
}

// rebuild prints where the replay ended and says whether the live
// projection ends there too, and checksums where the projection ends:
// two projections' checksums compare only where they end alike, and
// before, nothing said where either stood.
func TestRebuildSaysWhereTheProjectionsEnd(t *testing.T) {
	k := ledgertest.New(t, ledgertest.Options{Partitions: 2})
	group := k.Group("rebuild-ends")
	ev := k.Topics.Events
	produceAcross(t, k)
	st, dsn, db := freshProjection(t)
	stop := runProjector(t, k, group, st)
	ledgertest.WaitFor(t, 30*time.Second, func() error {
		pos, err := st.Positions(t.Context())
		if err != nil {
			return err
		}
		for partition := range int32(2) {
			if end, _ := pos.Lookup(ev, partition); end != 5 {
				return fmt.Errorf("%s/%d: the projection ends at %d; want 5", ev, partition, end)
			}
		}
		return nil
	})
	stop()
	flags := []string{"--kafka-brokers", strings.Join(k.Client.Brokers, ","), "--topic-events", ev, "--topic-control", k.Topics.Control,
		"--group", group, "--clickhouse-dsn", dsn, "--clickhouse-database", db}
	t.Cleanup(func() { chtest.DropDatabase(t, dsn, db+"_rebuild") })
	rebuild := append([]string{"projector", "rebuild"}, flags...)

	out := cli(t, rebuild...)
	if !strings.Contains(out, "ends "+ev+" 0:5 1:5") || !strings.Contains(out, "ends where the rebuild does") {
		t.Errorf("rebuild with the live projection caught up:\n%s\nwant its ends, and the live projection's the same", out)
	}
	if out := cli(t, append([]string{"projector", "checksums"}, flags...)...); !strings.Contains(out, "ends "+ev+" 0:5 1:5") {
		t.Errorf("checksums:\n%s\nwant where the projection ends", out)
	}
	produceAcross(t, k)
	if out := cli(t, rebuild...); !strings.Contains(out, "ends "+ev+" 0:10 1:10") || !strings.Contains(out, "ends elsewhere in 2 partitions") {
		t.Errorf("rebuild with the live projection behind:\n%s\nwant its ends, and the live projection's elsewhere in the events topic's 2 partitions", out)
	}
}

// runProjector runs a projector of group into st, with a lag refresh every
// 100 ms, until the returned stop is called.
func runProjector(t *testing.T, k *ledgertest.Kafka, group string, st *chstore.Store) (stop func()) {
	t.Helper()
	p, err := projector.New(projector.Config{Client: k.Client, Topics: k.Topics, Group: group, LagRefresh: 100 * time.Millisecond, MaxWait: 20 * time.Millisecond}, st)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(t.Context())
	done := make(chan error, 1)
	go func() { done <- p.Run(ctx) }()
	return func() {
		t.Helper()
		cancel()
		if err := <-done; err != nil {
			t.Fatalf("projector: %v", err)
		}
	}
}

// rebuild --swap keeps the control actions of the live tables that the
// compacted control topic no longer has (here, a tool's freeze, whose
// unfreeze is all the topic keeps), and says how many: the table is the
// history an incident's audit reads (who froze the tool, when and why),
// and before, the swap dropped them for good. An action the rebuild holds
// under another action id (a projector of an older build digested fewer
// of its fields) is not copied in beside it.
func TestRebuildSwapKeepsControlHistory(t *testing.T) {
	k := ledgertest.New(t, ledgertest.Options{Partitions: 2})
	produceAcross(t, k)
	at := time.Now().UTC().Truncate(time.Second)
	freeze := ledger.ControlAction{V: 1, Kind: "freeze", Subject: "tool:refund_order", Tool: "refund_order", By: "u_alice", ByTenant: "*", Reason: "bad refunds", At: at}
	unfreeze := ledger.ControlAction{V: 1, Kind: "unfreeze", Subject: "tool:refund_order", Tool: "refund_order", By: "u_bob", ByTenant: "*", Reason: "fixed", At: at.Add(time.Minute)}
	value, err := json.Marshal(unfreeze)
	if err != nil {
		t.Fatal(err)
	}
	produceOneEvent(t, k, &kgo.Record{Topic: k.Topics.Control, Key: []byte(unfreeze.Subject), Value: value})
	live, dsn, db := freshProjection(t)
	if err := live.Write(t.Context(), projections.Batch{Actions: []projections.Action{{Action: freeze}, {Action: unfreeze, Offset: 1}}}); err != nil {
		t.Fatal(err)
	}
	chtest.Exec(t, dsn, fmt.Sprintf("INSERT INTO `%s`.control_actions (subject, at, at_ns, action_id, kind, tool, by_user, by_tenant, reason) "+
		"SELECT 'tool:refund_order', toDateTime(%d), 0, 'older-build-id', 'unfreeze', 'refund_order', 'u_bob', '*', 'fixed'", db, unfreeze.At.Unix()))
	t.Cleanup(func() { chtest.Exec(t, dsn, "DROP DATABASE IF EXISTS `"+db+"_rebuild`") })
	out := cli(t, "projector", "rebuild", "--swap", "--kafka-brokers", strings.Join(k.Client.Brokers, ","),
		"--topic-events", k.Topics.Events, "--topic-control", k.Topics.Control, "--group", k.Group("keeps-history"),
		"--clickhouse-dsn", dsn, "--clickhouse-database", db)
	if !strings.Contains(out, "kept 1 control actions") || !strings.Contains(out, "swapped") {
		t.Errorf("rebuild --swap said:\n%s\nwant it swapped, keeping 1 control action", out)
	}
	q := "SELECT uniqExact(action_id) FROM `" + db + "`.control_actions WHERE "
	if frozen, unfrozen, all := chtest.Count(t, dsn, q+"kind = 'freeze' AND by_user = 'u_alice'"), chtest.Count(t, dsn, q+"kind = 'unfreeze'"), chtest.Count(t, dsn, q+"1"); frozen != 1 || unfrozen != 1 || all != 2 {
		t.Errorf("after the swap the live tables hold the freeze %d times, the unfreeze %d, and %d control actions; want 1, 1, and 2", frozen, unfrozen, all)
	}
}
