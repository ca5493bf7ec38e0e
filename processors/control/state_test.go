package control

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/toolcall-ledger/ledger/ledger"
	"github.com/toolcall-ledger/ledger/ledger/ledgertest"
	"github.com/toolcall-ledger/ledger/processors/identity"
)

// Operators the tests act as.
var (
	platformOp = identity.Identity{User: "op_root", Agent: "cli", Tenant: PlatformTenant, Roles: []string{"operator"}}
	acmeOp     = identity.Identity{User: "op_acme", Agent: "cli", Tenant: "t_acme", Roles: []string{"operator"}}
	otherOp    = identity.Identity{User: "op_other", Agent: "cli", Tenant: "t_other", Roles: []string{"operator"}}
	approver   = identity.Identity{User: "u_boss", Agent: "cli", Tenant: "t_acme", Roles: []string{"approver"}}
)

// kafkaPublisher publishes through a franz-go client, as the ledger's
// wiring does.
type kafkaPublisher struct{ cl *kgo.Client }

func newKafkaPublisher(t *testing.T, k *ledgertest.Kafka) *kafkaPublisher {
	t.Helper()
	cl, err := ledger.NewClient(k.Client, kgo.RecordPartitioner(ledger.Partitioner()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(cl.Close)
	return &kafkaPublisher{cl: cl}
}

func (p *kafkaPublisher) Publish(ctx context.Context, recs ...*kgo.Record) error {
	return p.cl.ProduceSync(ctx, recs...).FirstErr()
}

// runState starts a State on k's control topic; it stops when the test
// ends, and the test fails if Run failed.
func runState(t *testing.T, k *ledgertest.Kafka) *State {
	t.Helper()
	s := NewState(nil)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- s.Run(ctx, k.Client, k.Topics.Control) }() // exits when the test's cleanup cancels ctx
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("State.Run = %v; want nil after cancel", err)
		}
	})
	return s
}

func waitReady(t *testing.T, s *State) {
	t.Helper()
	select {
	case <-s.Ready():
	case <-time.After(15 * time.Second):
		t.Fatal("State not ready after 15s")
	}
}

// kafkaEnv is a Service on kfake, with its own State.
type kafkaEnv struct {
	k     *ledgertest.Kafka
	state *State
	svc   *Service
	pub   *kafkaPublisher
}

func newKafkaEnv(t *testing.T) kafkaEnv {
	t.Helper()
	return newKafkaEnvOn(t, ledgertest.New(t, ledgertest.Options{}))
}

// newKafkaEnvOn is newKafkaEnv on k.
func newKafkaEnvOn(t *testing.T, k *ledgertest.Kafka) kafkaEnv {
	t.Helper()
	st := runState(t, k)
	waitReady(t, st)
	pub := newKafkaPublisher(t, k)
	svc, err := New(Config{State: st, Publisher: pub, Identity: nopVerifier{}, Topics: k.Topics})
	if err != nil {
		t.Fatal(err)
	}
	return kafkaEnv{k: k, state: st, svc: svc, pub: pub}
}

// nopVerifier refuses every assertion; for tests that call Service's
// methods directly.
type nopVerifier struct{}

func (nopVerifier) Verify(context.Context, string) (identity.Identity, error) {
	return identity.Identity{}, errors.New("no assertions in this test")
}

func must[T any](t *testing.T) func(T, error) T {
	return func(v T, err error) T {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
		return v
	}
}

// Every instance honours a freeze within one second: the freeze made
// through one instance is seen by another State, measured from the moment
// the operator asked.
func TestFreezeReachesAnotherInstanceWithinOneSecond(t *testing.T) {
	t.Parallel()
	e := newKafkaEnv(t)
	other := runState(t, e.k)
	waitReady(t, other)

	// Readers on the hot path while records are applied (for -race).
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	go func() {
		for ctx.Err() == nil {
			other.Frozen("refund_order", "t_acme")
			other.Revoked("jti", "fam")
		}
	}()

	for i := range 5 {
		tool := fmt.Sprintf("tool_%d", i)
		start := time.Now()
		a, err := e.svc.Freeze(t.Context(), platformOp, tool, "", "incident 42")
		if err != nil {
			t.Fatalf("Freeze(%s) = %v", tool, err)
		}
		// Freeze returns once its own State applied it.
		if got, ok := e.state.Frozen(tool, "t_acme"); !ok || got.Subject != a.Subject {
			t.Fatalf("own State after Freeze: Frozen(%s) = %+v, %v; want the freeze", tool, got, ok)
		}
		for {
			if _, ok := other.Frozen(tool, "t_acme"); ok {
				break
			}
			if time.Since(start) > 5*time.Second {
				t.Fatalf("freeze of %s not seen by another instance after 5s", tool)
			}
			time.Sleep(time.Millisecond)
		}
		if took := time.Since(start); took >= time.Second {
			t.Errorf("freeze of %s seen by another instance after %s; want < 1s", tool, took)
		} else {
			t.Logf("freeze of %s seen by another instance after %s", tool, took)
		}
	}
}

// A new State started after freezes, unfreezes and revocations has all of
// them applied by the time Ready closes, with no polling.
func TestNewStateStartsWithCurrentState(t *testing.T) {
	t.Parallel()
	e := newKafkaEnv(t)
	ctx := t.Context()
	m := must[Action](t)
	frozen := m(e.svc.Freeze(ctx, platformOp, "refund_order", "", "refunds double-paying"))
	scoped := m(e.svc.Freeze(ctx, acmeOp, "send_email", "", "spam from acme's agent"))
	m(e.svc.Freeze(ctx, platformOp, "create_ticket", "", "noisy"))
	unfrozen := m(e.svc.Unfreeze(ctx, platformOp, "create_ticket", "", "fixed", time.Time{}))
	jti := m(e.svc.Revoke(ctx, platformOp, "jti-leaked", "", "token in a screenshot"))
	fam := m(e.svc.Revoke(ctx, acmeOp, "", "refund_order:t_acme:7", "executor compromised"))

	fresh := runState(t, e.k)
	waitReady(t, fresh)

	tests := []struct {
		name   string
		got    func() (Action, bool)
		want   Action
		wantOK bool
	}{
		{name: "freeze of every tenant", got: func() (Action, bool) { return fresh.Frozen("refund_order", "t_zeta") }, want: frozen, wantOK: true},
		{name: "tenant freeze, its tenant", got: func() (Action, bool) { return fresh.Frozen("send_email", "t_acme") }, want: scoped, wantOK: true},
		{name: "tenant freeze, another tenant", got: func() (Action, bool) { return fresh.Frozen("send_email", "t_other") }},
		{name: "unfrozen", got: func() (Action, bool) { return fresh.Frozen("create_ticket", "t_acme") }},
		{name: "revoked jti", got: func() (Action, bool) { return fresh.Revoked("jti-leaked", "get_weather:t_zeta:1") }, want: jti, wantOK: true},
		{name: "revoked family", got: func() (Action, bool) { return fresh.Revoked("jti-other", "refund_order:t_acme:7") }, want: fam, wantOK: true},
		{name: "another epoch", got: func() (Action, bool) { return fresh.Revoked("jti-other", "refund_order:t_acme:8") }},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			got, ok := tc.got()
			if ok != tc.wantOK {
				t.Fatalf("lookup = %+v, %v; want %v", got, ok, tc.wantOK)
			}
			if diff := cmp.Diff(tc.want, got); diff != "" {
				t.Errorf("action (-want +got):\n%s", diff)
			}
		})
	}
	snap := fresh.Snapshot()
	var subjects []string
	for _, a := range append(snap.Freezes, snap.Revocations...) {
		subjects = append(subjects, a.Subject)
	}
	want := []string{"tool:refund_order", "tool:send_email@t_acme", "family:refund_order:t_acme:7", "jti:jti-leaked"}
	if diff := cmp.Diff(want, subjects); diff != "" {
		t.Errorf("snapshot subjects (-want +got):\n%s", diff)
	}
	if unfrozen.Kind != KindUnfreeze || unfrozen.By != platformOp.User || unfrozen.Reason != "fixed" {
		t.Errorf("unfreeze = %+v; want a record of who unfroze and why", unfrozen)
	}
}

// Records the State cannot trust (undecodable, or whose fields do not make
// their key) are skipped without stopping it; a tombstone deletes its
// subject; transaction markers and aborted records do not keep Ready from
// closing, and aborted records are not applied.
func TestStateRecords(t *testing.T) {
	t.Parallel()
	k := ledgertest.New(t, ledgertest.Options{Partitions: 1})
	pub := newKafkaPublisher(t, k)
	freeze := func(tool, tenant string) Action {
		return Action{V: 1, Kind: KindFreeze, Subject: ToolSubject(tool, tenant), Tool: tool, Tenant: tenant, By: "op", ByTenant: "*", Reason: "r", At: time.Unix(1700000000, 0).UTC()}
	}
	rec := func(key string, a any) *kgo.Record {
		b, err := json.Marshal(a)
		if err != nil {
			t.Fatal(err)
		}
		return &kgo.Record{Topic: k.Topics.Control, Key: []byte(key), Value: b}
	}
	spoofed := freeze("refund_order", "")
	spoofed.Subject = "tool:send_email"
	ctx := t.Context()
	for _, r := range []*kgo.Record{
		{Topic: k.Topics.Control, Key: []byte("tool:get_weather"), Value: []byte("{not json")},
		rec("tool:send_email", spoofed), // the key does not match the fields
		rec("tool:create_ticket", Action{V: 1, Kind: "explode", Subject: "tool:create_ticket", Tool: "create_ticket"}),
		rec("tool:refund_order", freeze("refund_order", "")),
		rec("tool:create_ticket", freeze("create_ticket", "")),
		{Topic: k.Topics.Control, Key: []byte("tool:create_ticket")}, // tombstone
	} {
		if err := pub.Publish(ctx, r); err != nil {
			t.Fatal(err)
		}
	}
	// A committed transaction, then an aborted one: the partition ends
	// in a transaction marker.
	txn, err := ledger.NewClient(k.Client, kgo.TransactionalID("control-test"))
	if err != nil {
		t.Fatal(err)
	}
	defer txn.Close()
	for _, commit := range []kgo.TransactionEndTry{kgo.TryCommit, kgo.TryAbort} {
		if err := txn.BeginTransaction(); err != nil {
			t.Fatal(err)
		}
		tool := "get_weather"
		if commit == kgo.TryAbort {
			tool = "aborted_tool"
		}
		if err := txn.ProduceSync(ctx, rec(ToolSubject(tool, ""), freeze(tool, ""))).FirstErr(); err != nil {
			t.Fatal(err)
		}
		if err := txn.EndTransaction(ctx, commit); err != nil {
			t.Fatal(err)
		}
	}

	s := runState(t, k)
	waitReady(t, s)
	for _, tc := range []struct {
		tool   string
		frozen bool
	}{
		{"refund_order", true},
		{"get_weather", true}, // committed in a transaction
		{"send_email", false}, // only in the spoofed record
		{"create_ticket", false},
		{"aborted_tool", false},
	} {
		if _, got := s.Frozen(tc.tool, "t_acme"); got != tc.frozen {
			t.Errorf("Frozen(%s) = %v; want %v", tc.tool, got, tc.frozen)
		}
	}
	// A partition that ends in a transaction marker is read to its end:
	// the State stays current after Ready.
	time.Sleep(time.Second)
	short, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	if err := s.Current(short, 500*time.Millisecond); err != nil {
		t.Errorf("Current a second after Ready = %v; want nil", err)
	}
}

// toolRecord is a control record of tool's freeze (or unfreeze) at at, in
// partition p.
func toolRecord(t *testing.T, kind, tool string, p int32, at time.Time) *kgo.Record {
	t.Helper()
	b, err := json.Marshal(Action{V: ActionVersion, Kind: kind, Subject: ToolSubject(tool, ""), Tool: tool,
		By: "op", ByTenant: PlatformTenant, Reason: "r", At: at})
	if err != nil {
		t.Fatal(err)
	}
	return &kgo.Record{Key: []byte(ToolSubject(tool, "")), Value: b, Partition: p, Timestamp: at}
}

// Once partitions are added to the control topic, a subject's older
// records stay in its old partition and its newer ones go to another:
// across partitions the later record wins, in whichever order the fetches
// bring them; within one partition the log's order does, whatever the
// times say.
func TestLaterRecordWinsAcrossPartitions(t *testing.T) {
	t1 := time.Unix(1700000000, 0)
	t2 := t1.Add(time.Minute)
	for _, tc := range []struct {
		name   string
		recs   []*kgo.Record
		frozen bool
	}{
		{"newer partition first", []*kgo.Record{toolRecord(t, KindUnfreeze, "x", 3, t2), toolRecord(t, KindFreeze, "x", 1, t1)}, false},
		{"older partition first", []*kgo.Record{toolRecord(t, KindUnfreeze, "x", 1, t1), toolRecord(t, KindFreeze, "x", 3, t2)}, true},
		{"unfrozen, then refrozen by a newer partition's record read first",
			[]*kgo.Record{toolRecord(t, KindFreeze, "x", 3, t2), toolRecord(t, KindFreeze, "x", 1, t1), toolRecord(t, KindUnfreeze, "x", 1, t1.Add(time.Second))}, true},
		{"one partition, a clock stepped back", []*kgo.Record{toolRecord(t, KindFreeze, "x", 2, t2), toolRecord(t, KindUnfreeze, "x", 2, t1)}, false},
		{"a tombstone from the newer partition", []*kgo.Record{{Key: []byte(ToolSubject("x", "")), Partition: 3, Timestamp: t2}, toolRecord(t, KindFreeze, "x", 1, t1)}, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s := NewState(nil)
			for i, r := range tc.recs {
				r.Offset = int64(i)
				s.apply([]*kgo.Record{r})
			}
			if _, got := s.Frozen("x", "t_acme"); got != tc.frozen {
				t.Errorf("Frozen = %v; want %v", got, tc.frozen)
			}
		})
	}

	// A writer orders its record after the latest one its State applied,
	// even with its clock behind the writer of that one.
	s := NewState(nil)
	s.apply([]*kgo.Record{toolRecord(t, KindFreeze, "x", 3, t2)})
	if got := s.stamp(ToolSubject("x", ""), t1); !got.After(t2) {
		t.Errorf("stamp with the clock behind = %v; want after %v", got, t2)
	}
	if got := s.stamp(ToolSubject("x", ""), t2.Add(time.Hour)); !got.Equal(t2.Add(time.Hour)) {
		t.Errorf("stamp with the clock ahead = %v; want the clock's %v", got, t2.Add(time.Hour))
	}
}

// A partition added to the control topic while a State runs is read from
// its start: its records apply, and the State is current again, without
// a restart. It is never current as of a moment after such a record was
// written without having applied it: before, only one question for the
// ends in 40 asked which partitions the topic had, and the others moved
// AsOf past a freeze written to the added partition for up to 10 s.
func TestStateReadsPartitionAddedWhileRunning(t *testing.T) {
	t.Parallel()
	k := ledgertest.New(t, ledgertest.Options{Partitions: 1})
	s := runState(t, k)
	waitReady(t, s)
	ctx := t.Context()
	cl, err := ledger.NewClient(k.Client, kgo.RecordPartitioner(kgo.ManualPartitioner()))
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	if _, err := kadm.NewClient(cl).UpdatePartitions(ctx, 3, k.Topics.Control); err != nil {
		t.Fatal(err)
	}
	r := toolRecord(t, KindFreeze, "refund_order", 2, time.Now())
	r.Topic = k.Topics.Control
	if err := cl.ProduceSync(ctx, r).FirstErr(); err != nil {
		t.Fatal(err)
	}
	written := time.Now()
	ledgertest.WaitFor(t, 40*probeEvery, func() error {
		if s.AsOf().Before(written) {
			return errors.New("not current as of the freeze's write yet")
		}
		if _, frozen := s.Frozen("refund_order", "t_acme"); !frozen {
			t.Fatalf("current as of %s, after the freeze was written (%s), without it", s.AsOf().Format(time.RFC3339Nano), written.Format(time.RFC3339Nano))
		}
		return nil
	})
}

func TestRunMissingTopic(t *testing.T) {
	t.Parallel()
	k := ledgertest.New(t, ledgertest.Options{})
	s := NewState(nil)
	err := s.Run(t.Context(), k.Client, "no.such.topic")
	if err == nil {
		t.Fatal("Run on a missing topic = nil; want an error")
	}
	select {
	case <-s.Ready():
		t.Error("Ready closed after Run failed")
	default:
	}
	if err := s.Run(t.Context(), k.Client, k.Topics.Control); err == nil {
		t.Error("second Run = nil; want an error")
	}
}

// Stopped is closed only once Run has returned: ledger dev waits for it
// before it closes its in-process Kafka, whose closing a Run still
// fetching logged as errors after dev said it stopped.
func TestStoppedOnceRunReturns(t *testing.T) {
	t.Parallel()
	k := ledgertest.New(t, ledgertest.Options{})
	s := NewState(nil)
	ctx, cancel := context.WithCancel(t.Context())
	returned := make(chan error, 1)
	go func() { returned <- s.Run(ctx, k.Client, k.Topics.Control) }()
	waitReady(t, s)
	select {
	case <-s.Stopped():
		t.Fatal("Stopped closed while Run runs")
	default:
	}
	cancel()
	select {
	case <-s.Stopped():
	case <-time.After(15 * time.Second):
		t.Fatal("Stopped not closed 15s after Run's context ended")
	}
	if err := <-returned; err != nil {
		t.Errorf("Run = %v; want nil once its context ended", err)
	}
}

// Lookups are on every call's hot path: they must not allocate.
func TestLookupsDoNotAllocate(t *testing.T) {
	s := NewState(nil)
	s.tools[freezeKey{tool: "refund_order", tenant: "t_acme"}] = Action{Kind: KindFreeze, Subject: "tool:refund_order@t_acme"}
	s.families["refund_order:t_acme:1"] = Action{Kind: KindRevoke}
	s.asOf.Store(time.Now().UnixNano())
	tool, tenant, jti, fam := "refund_order", "t_acme", "jti-1", "refund_order:t_acme:1"
	ctx := t.Context()
	var sink bool
	allocs := testing.AllocsPerRun(1000, func() {
		_, a := s.Frozen(tool, tenant)
		_, b := s.Revoked(jti, fam)
		_, c := s.Frozen("send_email", tenant)
		sink = a && b && !c && s.Current(ctx, time.Hour) == nil
	})
	if !sink {
		t.Fatal("lookups did not find the freeze and the revocation, or the State was not current")
	}
	if allocs != 0 {
		t.Errorf("Frozen + Revoked + Current allocate %v times per call; want 0", allocs)
	}
}

func BenchmarkFrozen(b *testing.B) {
	s := NewState(nil)
	for i := range 1000 {
		s.tools[freezeKey{tool: fmt.Sprintf("tool_%d", i), tenant: "t_acme"}] = Action{Kind: KindFreeze}
	}
	b.ReportAllocs()
	b.RunParallel(func(pb *testing.PB) {
		for pb.Next() {
			s.Frozen("tool_500", "t_acme")
		}
	})
}

// BenchmarkCurrent is the check before every request to a tool, on a
// current State: a monotonic clock reading and an atomic load.
func BenchmarkCurrent(b *testing.B) {
	s := NewState(nil)
	markCurrent(s, time.Now().Add(time.Hour))
	ctx := b.Context()
	b.ReportAllocs()
	b.RunParallel(func(pb *testing.PB) {
		for pb.Next() {
			if s.Current(ctx, DefaultMaxStaleness) != nil {
				b.Fatal("not current")
			}
		}
	})
}

// A State started after retention (or DeleteRecords) took every record of
// a control partition is ready, and current, at once: the partition's
// end is no offset it could ever read up to. Before, it waited for it
// forever, and every process restarted since failed to start. Live
// States keep the actions they read before the deletion.
func TestStateReadyOverAnEmptiedPartition(t *testing.T) {
	t.Parallel()
	e := newKafkaEnv(t)
	ctx := t.Context()
	must[Action](t)(e.svc.Freeze(ctx, platformOp, "refund_order", "", "refunds double-paying"))
	cl := e.pub.cl
	adm := kadm.NewClient(cl)
	ends, err := adm.ListEndOffsets(ctx, e.k.Topics.Control)
	if err != nil {
		t.Fatal(err)
	}
	del := kadm.Offsets{}
	ends.Each(func(o kadm.ListedOffset) {
		if o.Offset > 0 {
			del.AddOffset(o.Topic, o.Partition, o.Offset, -1)
		}
	})
	if len(del) == 0 {
		t.Fatal("the control topic holds no record to delete")
	}
	resps, err := adm.DeleteRecords(ctx, del)
	if err == nil {
		err = resps.Error()
	}
	if err != nil {
		t.Fatalf("delete records: %v", err)
	}
	fresh := runState(t, e.k)
	waitReady(t, fresh)
	// Current once the probes that follow have to say so: past the
	// moment it was ready.
	time.Sleep(500 * time.Millisecond)
	cctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	if err := fresh.Current(cctx, 100*time.Millisecond); err != nil {
		t.Errorf("Current over an emptied partition = %v; want nil", err)
	}
	if _, ok := e.state.Frozen("refund_order", "t_acme"); !ok {
		t.Error("the live State lost the freeze it read before the deletion")
	}
}

// A partition emptied after a State began but before it read its records
// (its fetch held meanwhile) is read to its end by the State's probes:
// Ready closes. Before, Ready waited for a record that could never come,
// and the process gave up at its start.
func TestStateReadyOverAPartitionEmptiedWhileStarting(t *testing.T) {
	e := newKafkaEnvOn(t, ledgertest.NewInProcess(t, ledgertest.Options{}))
	k := e.k
	ctx := t.Context()
	must[Action](t)(e.svc.Freeze(ctx, platformOp, "refund_order", "", "refunds double-paying"))
	adm := kadm.NewClient(e.pub.cl)
	ends, err := adm.ListEndOffsets(ctx, k.Topics.Control)
	if err != nil {
		t.Fatal(err)
	}
	release := ledgertest.StallFetches(t, k.Cluster)
	fresh := runState(t, k)
	// Its Run has listed the ends (the freeze's partition not empty)
	// and waits on a held fetch: empty the partition now.
	time.Sleep(300 * time.Millisecond)
	del := kadm.Offsets{}
	ends.Each(func(o kadm.ListedOffset) {
		if o.Offset > 0 {
			del.AddOffset(o.Topic, o.Partition, o.Offset, -1)
		}
	})
	resps, err := adm.DeleteRecords(ctx, del)
	if err == nil {
		err = resps.Error()
	}
	if err != nil {
		t.Fatalf("delete records: %v", err)
	}
	release()
	waitReady(t, fresh)
}

// Every copy passes over alike a tenant operator's action on a platform
// operator's freeze, and an unfreeze of a freeze no longer in force (its
// Lifts); an unfreeze of an older build, without Lifts, lifts whatever
// is in force, as before.
func TestStatePassesOverOverruledActions(t *testing.T) {
	at := time.Date(2026, 12, 6, 12, 0, 0, 0, time.UTC)
	act := func(kind, byTenant string, at time.Time, lifts *time.Time) Action {
		return Action{V: 1, Kind: kind, Subject: "tool:refund_order@t_acme", Tool: "refund_order", Tenant: "t_acme",
			By: "op_" + byTenant, ByTenant: byTenant, Reason: "r", At: at, Lifts: lifts}
	}
	platform := act(KindFreeze, PlatformTenant, at, nil)
	stale, current := at.Add(-time.Hour), platform.At
	for _, tc := range []struct {
		name   string
		then   Action
		frozen bool
		by     string
	}{
		{"a tenant's unfreeze", act(KindUnfreeze, "t_acme", at.Add(time.Second), &current), true, "op_*"},
		{"a tenant's freeze", act(KindFreeze, "t_acme", at.Add(time.Second), nil), true, "op_*"},
		{"an unfreeze of another freeze", act(KindUnfreeze, PlatformTenant, at.Add(time.Second), &stale), true, "op_*"},
		{"an unfreeze of the freeze in force", act(KindUnfreeze, PlatformTenant, at.Add(time.Second), &current), false, ""},
		{"an older build's unfreeze", act(KindUnfreeze, PlatformTenant, at.Add(time.Second), nil), false, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			st := readyState()
			var recs []*kgo.Record
			for i, a := range []Action{platform, tc.then} {
				value, err := json.Marshal(a)
				if err != nil {
					t.Fatal(err)
				}
				recs = append(recs, &kgo.Record{Key: []byte(a.Subject), Value: value, Timestamp: a.At, Offset: int64(i)})
			}
			st.apply(recs)
			if a, ok := st.Frozen("refund_order", "t_acme"); ok != tc.frozen || a.By != tc.by {
				t.Errorf("Frozen = %+v, %v; want frozen %v by %q", a, ok, tc.frozen, tc.by)
			}
		})
	}
}

// CurrentAsOf waits for a question to the broker asked after its time to
// be answered and applied: then AsOf is that time or later. One about a
// time the State cannot reach before ctx ends is a StaleError.
func TestStateCurrentAsOf(t *testing.T) {
	t.Parallel()
	k := ledgertest.New(t, ledgertest.Options{Partitions: 1})
	s := runState(t, k)
	waitReady(t, s)
	at := time.Now()
	ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
	defer cancel()
	if err := s.CurrentAsOf(ctx, at); err != nil {
		t.Fatalf("CurrentAsOf(now) = %v; want nil within a probe", err)
	}
	if got := s.AsOf(); got.Before(at) {
		t.Errorf("CurrentAsOf(%s) returned with AsOf %s, before it", at.Format(time.RFC3339Nano), got.Format(time.RFC3339Nano))
	}
	short, cancel2 := context.WithTimeout(t.Context(), 300*time.Millisecond)
	defer cancel2()
	if err := s.CurrentAsOf(short, time.Now().Add(time.Hour)); !errors.Is(err, ErrStale) {
		t.Errorf("CurrentAsOf(an hour ahead) = %v; want ErrStale", err)
	}
}
