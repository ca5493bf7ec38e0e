package loadtest

import (
	"context"
	"fmt"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/toolcall-ledger/ledger/ledger"
	"github.com/toolcall-ledger/ledger/ledger/ledgertest"
	"github.com/toolcall-ledger/ledger/processors"
	"github.com/toolcall-ledger/ledger/processors/boltstore"
	"github.com/toolcall-ledger/ledger/processors/pgstore"
	"github.com/toolcall-ledger/ledger/processors/storetest"
)

// limitProgressLog collects progress calls, which come from another
// goroutine.
type limitProgressLog struct {
	mu   sync.Mutex
	done []int
}

func (p *limitProgressLog) add(n int) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.done = append(p.done, n)
}

// check fails t unless the calls never went back and the last was last.
func (p *limitProgressLog) check(t *testing.T, last int) {
	t.Helper()
	p.mu.Lock()
	defer p.mu.Unlock()
	if len(p.done) == 0 {
		t.Fatalf("progress never called; want calls ending at %d", last)
	}
	if !slices.IsSorted(p.done) {
		t.Errorf("progress calls = %v; want never decreasing", p.done)
	}
	if got := p.done[len(p.done)-1]; got != last {
		t.Errorf("last progress call = %d; want %d", got, last)
	}
}

// limitReadKeys returns the keys of every committed record of topic, read
// to the end offsets listed now.
func limitReadKeys(t *testing.T, ctx context.Context, cc ledger.ClientConfig, topic string) []string {
	t.Helper()
	admin, err := ledger.NewClient(cc)
	if err != nil {
		t.Fatalf("admin client: %v", err)
	}
	defer admin.Close()
	ends, err := kadm.NewClient(admin).ListEndOffsets(ctx, topic)
	if err == nil {
		err = ends.Error()
	}
	if err != nil {
		t.Fatalf("ListEndOffsets(%s) = %v", topic, err)
	}
	left := make(map[int32]int64)
	ends.Each(func(o kadm.ListedOffset) {
		if o.Offset > 0 {
			left[o.Partition] = o.Offset
		}
	})
	// Markers are kept: they hold the last offset of a transactional
	// partition, which tells the read it is done.
	cl, err := ledger.NewClient(cc, kgo.ConsumeTopics(topic), kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()), kgo.KeepControlRecords())
	if err != nil {
		t.Fatalf("consumer: %v", err)
	}
	defer cl.Close()
	ctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	var keys []string
	for len(left) > 0 {
		fetches := cl.PollFetches(ctx)
		if err := fetches.Err(); err != nil {
			t.Fatalf("read %s with %d partitions left: %v", topic, len(left), err)
		}
		fetches.EachRecord(func(r *kgo.Record) {
			if r.Offset >= left[r.Partition]-1 {
				delete(left, r.Partition)
			}
			if !r.Attrs.IsControl() {
				keys = append(keys, string(r.Key))
			}
		})
	}
	slices.Sort(keys)
	return keys
}

// limitTopics lists the topics of the cluster that a Kafka limit run
// creates.
func limitTopics(t *testing.T, cc ledger.ClientConfig) []string {
	t.Helper()
	admin, err := ledger.NewClient(cc)
	if err != nil {
		t.Fatalf("admin client: %v", err)
	}
	defer admin.Close()
	details, err := kadm.NewClient(admin).ListTopics(t.Context())
	if err != nil {
		t.Fatalf("ListTopics() = %v", err)
	}
	var names []string
	for _, name := range details.Names() {
		if strings.HasPrefix(name, limitTopicPrefix) {
			names = append(names, name)
		}
	}
	return names
}

// TestKafkaTxnLimit: the run copies every record exactly once in
// committed transactions, reports it, and removes its topics.
func TestKafkaTxnLimit(t *testing.T) {
	const records, batch, partitions = 3000, 500, 4
	k := ledgertest.New(t, ledgertest.Options{Partitions: partitions})
	var (
		prog    limitProgressLog
		checked bool
		names   []string
	)
	l, err := limitKafkaTxn(t.Context(), k.Client, records, batch, partitions, prog.add, func(ctx context.Context, source, sink string) error {
		// Independently of the run's own count: the sink holds, committed,
		// exactly the source's keys, each once.
		src := limitReadKeys(t, ctx, k.Client, source)
		if len(src) != records || len(slices.Compact(slices.Clone(src))) != records {
			t.Errorf("source %s holds %d records, %d distinct keys; want %d each", source, len(src), len(slices.Compact(slices.Clone(src))), records)
		}
		if diff := cmp.Diff(src, limitReadKeys(t, ctx, k.Client, sink)); diff != "" {
			t.Errorf("sink %s keys differ from the source's (-source +sink):\n%s", sink, diff)
		}
		checked = true
		names = []string{source, sink}
		return nil
	})
	if err != nil {
		t.Fatalf("KafkaTxnLimit() = %v", err)
	}
	if !checked {
		t.Fatal("the topics were never handed to the check before deletion")
	}
	t.Logf("%s: %d records in %v = %.0f/s (%s)", l.Name, l.Ops, l.Elapsed, l.PerSec, l.Note)
	if l.Name != limitNameKafka || l.Ops != records || l.Batch != batch {
		t.Errorf("KafkaTxnLimit() = %+v; want name %s, ops %d, batch %d", l, limitNameKafka, records, batch)
	}
	if l.Elapsed <= 0 || l.PerSec <= 0 || l.Note == "" {
		t.Errorf("KafkaTxnLimit() = %+v; want a positive elapsed and rate, and a note", l)
	}
	prog.check(t, records)
	for _, name := range names {
		if !strings.HasPrefix(name, limitTopicPrefix) {
			t.Errorf("topic %s: want prefix %s", name, limitTopicPrefix)
		}
	}
	if got := limitTopics(t, k.Client); len(got) != 0 {
		t.Errorf("topics left after the run: %v; want them deleted", got)
	}
}

// TestKafkaTxnLimitUnevenBatch: through the exported function, with a
// batch that does not divide the records, so that the last transaction is
// a short one.
func TestKafkaTxnLimitUnevenBatch(t *testing.T) {
	k := ledgertest.New(t, ledgertest.Options{Partitions: 1})
	l, err := KafkaTxnLimit(t.Context(), k.Client, 101, 7, 3, nil)
	if err != nil {
		t.Fatalf("KafkaTxnLimit(101 records, batch 7) = %v", err)
	}
	t.Logf("%s: %d records in %v = %.0f/s", l.Name, l.Ops, l.Elapsed, l.PerSec)
	if l.Ops != 101 || l.Batch != 7 || l.PerSec <= 0 {
		t.Errorf("KafkaTxnLimit(101 records, batch 7) = %+v; want 101 ops, batch 7, a positive rate", l)
	}
}

// TestLimitCountSink: the read-back that guards the Kafka limit counts
// committed records only, and tells lost, duplicated and foreign ones.
func TestLimitCountSink(t *testing.T) {
	const prefix = "t_limit/abc-"
	key := func(i int) string { return fmt.Sprintf("%s%d", prefix, i) }
	upTo := func(n int) []string {
		var ks []string
		for i := range n {
			ks = append(ks, key(i))
		}
		return ks
	}
	tests := []struct {
		name string
		// txns are produced in order, each in its own transaction;
		// abort[i] aborts txns[i].
		txns  [][]string
		abort []bool
		want  limitSinkCount
	}{
		{"exact", [][]string{upTo(5)}, nil, limitSinkCount{Total: 5}},
		{"exact over transactions", [][]string{upTo(2), {key(2), key(3), key(4)}}, nil, limitSinkCount{Total: 5}},
		{"aborted copy not counted", [][]string{upTo(5), {key(1)}}, []bool{false, true}, limitSinkCount{Total: 5}},
		{"missing", [][]string{{key(0), key(1), key(3), key(4)}}, nil, limitSinkCount{Total: 4, Missing: 1}},
		{"aborted only", [][]string{upTo(5)}, []bool{true}, limitSinkCount{Missing: 5}},
		{"duplicated", [][]string{upTo(5), {key(2), key(2)}}, nil, limitSinkCount{Total: 7, Duplicated: 2}},
		{"foreign", [][]string{append(upTo(5), "t_limit/other-1", prefix+"x", key(5))}, nil, limitSinkCount{Total: 8, Foreign: 3}},
		{"empty", nil, nil, limitSinkCount{Missing: 5}},
	}
	k := ledgertest.New(t, ledgertest.Options{Partitions: 1})
	admin, err := ledger.NewClient(k.Client)
	if err != nil {
		t.Fatalf("admin client: %v", err)
	}
	defer admin.Close()
	adm := kadm.NewClient(admin)
	for n, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			ctx := t.Context()
			topic := fmt.Sprintf("%scount-%d", limitTopicPrefix, n)
			if _, err := adm.CreateTopic(ctx, 3, 1, nil, topic); err != nil {
				t.Fatalf("create topic: %v", err)
			}
			cl, err := ledger.NewClient(k.Client, kgo.TransactionalID(topic), kgo.DefaultProduceTopic(topic), kgo.RecordPartitioner(ledger.Partitioner()))
			if err != nil {
				t.Fatalf("producer: %v", err)
			}
			defer cl.Close()
			for i, keys := range tc.txns {
				if err := cl.BeginTransaction(); err != nil {
					t.Fatalf("begin: %v", err)
				}
				for _, key := range keys {
					if err := cl.ProduceSync(ctx, &kgo.Record{Key: []byte(key), Value: []byte("v")}).FirstErr(); err != nil {
						t.Fatalf("produce %s: %v", key, err)
					}
				}
				commit := kgo.TryCommit
				if i < len(tc.abort) && tc.abort[i] {
					commit = kgo.TryAbort
				}
				if err := cl.EndTransaction(ctx, commit); err != nil {
					t.Fatalf("end transaction: %v", err)
				}
			}
			got, err := limitCountSink(ctx, k.Client, topic, prefix, 5)
			if err != nil {
				t.Fatalf("limitCountSink() = %v", err)
			}
			if diff := cmp.Diff(tc.want, got); diff != "" {
				t.Errorf("limitCountSink() mismatch (-want +got):\n%s", diff)
			}
			if got.exact() != (tc.want == limitSinkCount{Total: 5}) {
				t.Errorf("exact() = %v for %+v", got.exact(), got)
			}
		})
	}
}

// limitStores opens each store ClaimLimit runs against in the benchmark:
// the embedded bbolt one and PostgreSQL (standing in for CockroachDB).
func limitStores() []struct {
	name string
	open func(t *testing.T) processors.Store
} {
	return []struct {
		name string
		open func(t *testing.T) processors.Store
	}{
		{"boltstore", func(t *testing.T) processors.Store {
			s, err := boltstore.Open(boltstore.Config{Path: filepath.Join(t.TempDir(), "executions.db")})
			if err != nil {
				t.Fatalf("boltstore.Open() = %v", err)
			}
			t.Cleanup(func() { _ = s.Close() })
			return s
		}},
		{"pgstore", func(t *testing.T) processors.Store {
			dsn := storetest.PGDSN(t)
			s, err := pgstore.Open(t.Context(), pgstore.Config{DSN: dsn, Schema: storetest.FreshSchema(t, dsn)})
			if err != nil {
				t.Fatalf("pgstore.Open() = %v", err)
			}
			t.Cleanup(func() { _ = s.Close() })
			return s
		}},
	}
}

// TestClaimLimit: every call is claimed, completed and marked logged, and
// both limits say so.
func TestClaimLimit(t *testing.T) {
	const calls, batch = 2000, 500
	for _, store := range limitStores() {
		t.Run(store.name, func(t *testing.T) {
			st := store.open(t)
			ctx := t.Context()
			var prog limitProgressLog
			got, err := ClaimLimit(ctx, st, calls, batch, prog.add)
			if err != nil {
				t.Fatalf("ClaimLimit() = %v", err)
			}
			for _, l := range got {
				t.Logf("%s %s: %d calls in %v = %.0f/s (%s)", store.name, l.Name, l.Ops, l.Elapsed, l.PerSec, l.Note)
			}
			var names []string
			for _, l := range got {
				names = append(names, l.Name)
				if l.Ops != calls || l.Batch != batch || l.Elapsed <= 0 || l.PerSec <= 0 || l.Note == "" {
					t.Errorf("limit %+v; want ops %d, batch %d, a positive elapsed and rate, a note", l, calls, batch)
				}
			}
			if diff := cmp.Diff([]string{limitNameClaims, limitNameComplete}, names); diff != "" {
				t.Errorf("limit names mismatch (-want +got):\n%s", diff)
			}
			prog.check(t, 3*calls)

			done, err := st.ByStatus(ctx, processors.StatusSucceeded, 2*calls)
			if err != nil {
				t.Fatalf("ByStatus(succeeded) = %v", err)
			}
			if len(done) != calls {
				t.Fatalf("ByStatus(succeeded) = %d records; want %d", len(done), calls)
			}
			for _, s := range []processors.Status{processors.StatusAuthorized, processors.StatusExecuting} {
				if left, err := st.ByStatus(ctx, s, 10); err != nil || len(left) != 0 {
					t.Errorf("ByStatus(%s) = %d records, %v; want none", s, len(left), err)
				}
			}
			for _, i := range []int{0, calls / 2, calls - 1} {
				rec, err := st.Get(ctx, done[i].Key)
				if err != nil {
					t.Fatalf("Get(%v) = %v", done[i].Key, err)
				}
				want := limitWantRecord{Tenant: limitTenant, Status: processors.StatusSucceeded, Epoch: 1, Attempt: 1, Seq: 4, LoggedSeq: 4}
				got := limitWantRecord{rec.Key.TenantID, rec.Status, rec.Epoch, rec.Attempt, rec.Seq, rec.LoggedSeq, rec.LeaseOwner}
				if diff := cmp.Diff(want, got); diff != "" {
					t.Errorf("Get(%v) mismatch (-want +got):\n%s", rec.Key, diff)
				}
				evs, err := ledger.DecodeEvents(rec.Outbox)
				if err != nil {
					t.Fatalf("outbox of %v: %v", rec.Key, err)
				}
				var seqs []int64
				for _, e := range evs {
					seqs = append(seqs, e.Seq)
				}
				if diff := cmp.Diff([]int64{3, 4}, seqs); diff != "" {
					t.Errorf("outbox seqs of %v mismatch (-want +got):\n%s", rec.Key, diff)
				}
			}
		})
	}
}

// limitWantRecord is the part of a record ClaimLimit decides.
type limitWantRecord struct {
	Tenant     string
	Status     processors.Status
	Epoch      int64
	Attempt    int
	Seq        int64
	LoggedSeq  int64
	LeaseOwner string
}

// limitShortStore is a store that does less than asked, in one way.
type limitShortStore struct {
	processors.Store
	busyClaim    bool // one claim comes back Busy
	fencedDone   bool // one completion is not applied
	shortResults bool // Claim returns one result too few
}

func (s limitShortStore) Claim(ctx context.Context, cs []processors.Claim) ([]processors.ClaimResult, error) {
	res, err := s.Store.Claim(ctx, cs)
	if err != nil || len(res) == 0 {
		return res, err
	}
	if s.busyClaim {
		res[len(res)-1].Outcome = processors.Busy
	}
	if s.shortResults {
		res = res[:len(res)-1]
	}
	return res, nil
}

func (s limitShortStore) Complete(ctx context.Context, cs []processors.Completion) ([]bool, error) {
	applied, err := s.Store.Complete(ctx, cs)
	if err == nil && s.fencedDone && len(applied) > 0 {
		applied[0] = false
	}
	return applied, err
}

// TestClaimLimitShortWork: a store that claims or completes less than
// asked fails the run instead of yielding a rate for work not done.
func TestClaimLimitShortWork(t *testing.T) {
	tests := []struct {
		name  string
		store limitShortStore
	}{
		{"busy claim", limitShortStore{busyClaim: true}},
		{"fenced completion", limitShortStore{fencedDone: true}},
		{"missing claim result", limitShortStore{shortResults: true}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			st := tc.store
			st.Store = limitStores()[0].open(t)
			if got, err := ClaimLimit(t.Context(), st, 20, 8, nil); err == nil {
				t.Errorf("ClaimLimit() = %+v, nil; want an error", got)
			}
		})
	}
}

// TestLimitInvalid: arguments that ask for no work are refused, before
// anything is created.
func TestLimitInvalid(t *testing.T) {
	st := limitStores()[0].open(t)
	claims := []struct {
		name         string
		store        processors.Store
		calls, batch int
	}{
		{"no store", nil, 10, 5},
		{"zero calls", st, 0, 5},
		{"negative calls", st, -1, 5},
		{"zero batch", st, 10, 0},
		{"negative batch", st, 10, -3},
	}
	for _, tc := range claims {
		t.Run("ClaimLimit/"+tc.name, func(t *testing.T) {
			if got, err := ClaimLimit(t.Context(), tc.store, tc.calls, tc.batch, nil); err == nil {
				t.Errorf("ClaimLimit(calls %d, batch %d) = %+v, nil; want an error", tc.calls, tc.batch, got)
			}
		})
	}
	if recs, err := st.ByStatus(t.Context(), processors.StatusAuthorized, 10); err != nil || len(recs) != 0 {
		t.Errorf("ByStatus(authorized) after refused runs = %d records, %v; want none", len(recs), err)
	}

	k := ledgertest.New(t, ledgertest.Options{Partitions: 1})
	kafka := []struct {
		name                       string
		records, batch, partitions int
	}{
		{"zero records", 0, 10, 1},
		{"negative records", -5, 10, 1},
		{"zero batch", 10, 0, 1},
		{"negative batch", 10, -1, 1},
		{"zero partitions", 10, 10, 0},
		{"negative partitions", 10, 10, -2},
	}
	for _, tc := range kafka {
		t.Run("KafkaTxnLimit/"+tc.name, func(t *testing.T) {
			if got, err := KafkaTxnLimit(t.Context(), k.Client, tc.records, tc.batch, tc.partitions, nil); err == nil {
				t.Errorf("KafkaTxnLimit(records %d, batch %d, partitions %d) = %+v, nil; want an error", tc.records, tc.batch, tc.partitions, got)
			}
		})
	}
	if got := limitTopics(t, k.Client); len(got) != 0 {
		t.Errorf("topics after refused runs: %v; want none", got)
	}
}
