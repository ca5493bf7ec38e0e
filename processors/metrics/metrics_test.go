package metrics

import (
	"fmt"
	"iter"
	"maps"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/toolcall-ledger/ledger/ledger"
)

// TestStoreRetried: each retry the store reports is counted under its
// operation and the process's role.
func TestStoreRetried(t *testing.T) {
	r := New("executor", nil)
	r.StoreRetried("claim")
	r.StoreRetried("claim")
	r.StoreRetried("complete")
	got := map[string]float64{}
	for labels, v := range counters(t, r, "ledger_store_retries_total") {
		if labels["role"] != "executor" {
			t.Errorf("series %v; want role executor", labels)
		}
		got[labels["op"]] = v
	}
	if got["claim"] != 2 || got["complete"] != 1 || len(got) != 2 {
		t.Errorf("ledger_store_retries_total by op = %v; want claim 2, complete 1", got)
	}
}

// eventRecord is an appended event's record as the loops report it: its
// type and tool in headers; typ "" is a DLQ record, which has neither.
func eventRecord(typ, tool string) *kgo.Record {
	rec := &kgo.Record{Value: []byte("{}")}
	if typ != "" {
		rec.Headers = []kgo.RecordHeader{
			{Key: ledger.HeaderEventType, Value: []byte(typ)},
			{Key: ledger.HeaderTool, Value: []byte(tool)},
		}
	}
	return rec
}

// counters yields the series of the counter name in r: their labels and
// values.
func counters(t *testing.T, r *Registry, name string) iter.Seq2[map[string]string, float64] {
	t.Helper()
	fams, err := r.Gatherer().Gather()
	if err != nil {
		t.Fatal(err)
	}
	return func(yield func(map[string]string, float64) bool) {
		for _, f := range fams {
			if f.GetName() != name {
				continue
			}
			for _, m := range f.GetMetric() {
				labels := map[string]string{}
				for _, l := range m.GetLabel() {
					labels[l.GetName()] = l.GetValue()
				}
				if !yield(labels, m.GetCounter().GetValue()) {
					return
				}
			}
		}
	}
}

// eventSeries returns ledger_events_total by "type/tool".
func eventSeries(t *testing.T, r *Registry) map[string]float64 {
	t.Helper()
	got := map[string]float64{}
	for labels, v := range counters(t, r, "ledger_events_total") {
		got[labels["type"]+"/"+labels["tool"]] = v
	}
	return got
}

// TestEventsByRegisteredTool: events are counted by type and tool, and a
// tool the registry does not hold (the tool a refused envelope named,
// whatever its sender made up) is counted as UnregisteredTool, so that
// senders cannot add series.
func TestEventsByRegisteredTool(t *testing.T) {
	r := New("intake", func(tool string) bool { return tool == "create_ticket" || tool == "get_weather" })
	r.Committed(7, []*kgo.Record{
		eventRecord("authorized", "create_ticket"), eventRecord("authorized", "create_ticket"),
		eventRecord("authorized", "get_weather"),
		eventRecord("denied", "create_ticket"),
		eventRecord("denied", "made_up_1"), eventRecord("denied", "made_up_2"),
		eventRecord("denied", ""), // an envelope too broken to name its tool
		eventRecord("", ""),       // the DLQ's
	}, time.Millisecond, time.Millisecond)
	want := map[string]float64{
		"authorized/create_ticket": 2, "authorized/get_weather": 1,
		"denied/create_ticket": 1, "denied/" + UnregisteredTool: 2, "denied/": 1,
	}
	if diff := cmp.Diff(want, eventSeries(t, r)); diff != "" {
		t.Errorf("ledger_events_total (-want +got):\n%s", diff)
	}

	// A thousand more names made up: no series, and nothing kept, per name.
	var recs []*kgo.Record
	for i := range 1000 {
		recs = append(recs, eventRecord("denied", fmt.Sprintf("made_up_%d", i+3)))
	}
	r.Committed(len(recs), recs, time.Millisecond, time.Millisecond)
	want["denied/"+UnregisteredTool] += 1000
	if diff := cmp.Diff(want, eventSeries(t, r)); diff != "" {
		t.Errorf("ledger_events_total after 1000 made-up tools (-want +got):\n%s", diff)
	}
	if n := len(r.events.byType["denied"]); n != 3 {
		t.Errorf("denied events' counters cached: %d; want 3 (create_ticket, %s, none)", n, UnregisteredTool)
	}

	// Without a registry every named tool is unregistered.
	r = New("reconciler", nil)
	r.Committed(1, []*kgo.Record{eventRecord("succeeded", "create_ticket")}, 0, 0)
	if diff := cmp.Diff(map[string]float64{"succeeded/" + UnregisteredTool: 1}, eventSeries(t, r)); diff != "" {
		t.Errorf("ledger_events_total with no registry (-want +got):\n%s", diff)
	}
}

// The DLQ records a transaction committed are counted by reason, and
// batches skipped for their size and failed fetches by topic. Before, nothing counted the
// DLQ: a comment said something else did.
func TestDLQAndSkippedBatchesCounted(t *testing.T) {
	r := New("intake", nil)
	dlq := func(reason string) *kgo.Record {
		return &kgo.Record{Headers: []kgo.RecordHeader{{Key: ledger.HeaderDLQReason, Value: []byte(reason)}}}
	}
	r.Committed(3, []*kgo.Record{dlq("invalid_json"), dlq("invalid_json"), dlq(ledger.ReasonBatchTooLarge), eventRecord("denied", "")}, 0, 0)
	r.BatchSkipped("toolcalls.requests")
	r.FetchFailed("toolcalls.events")
	r.FetchFailed("toolcalls.events")
	got := map[string]float64{}
	for labels, v := range counters(t, r, "ledger_dlq_records_total") {
		got["dlq/"+labels["reason"]] = v
	}
	for labels, v := range counters(t, r, "ledger_batches_skipped_total") {
		got["skipped/"+labels["topic"]] = v
	}
	for labels, v := range counters(t, r, "ledger_fetch_errors_total") {
		got["fetch/"+labels["topic"]] = v
	}
	want := map[string]float64{"dlq/invalid_json": 2, "dlq/" + ledger.ReasonBatchTooLarge: 1, "skipped/toolcalls.requests": 1, "fetch/toolcalls.events": 2}
	if diff := cmp.Diff(want, got); diff != "" {
		t.Errorf("DLQ and skipped batch counters (-want +got):\n%s", diff)
	}
}

// BenchmarkEventCounters compares, in one run, counting a committed
// batch's events through the cached counters (Committed's way) with
// looking each one up by its labels (its former way).
func BenchmarkEventCounters(b *testing.B) {
	known := func(tool string) bool { return tool == "create_ticket" || tool == "get_weather" }
	var recs []*kgo.Record
	for i := range 64 {
		typ := []string{"requested", "authorized", "executing", "succeeded"}[i%4]
		recs = append(recs, eventRecord(typ, []string{"create_ticket", "get_weather"}[i/4%2]))
	}
	b.Run("labels", func(b *testing.B) {
		r := New("bench", known)
		b.ReportAllocs()
		for b.Loop() {
			for _, rec := range recs {
				r.events.vec.WithLabelValues(string(ledger.Header(rec, ledger.HeaderEventType)), string(ledger.Header(rec, ledger.HeaderTool))).Inc()
			}
		}
	})
	b.Run("cached", func(b *testing.B) {
		r := New("bench", known)
		b.ReportAllocs()
		for b.Loop() {
			for _, rec := range recs {
				r.events.counter(ledger.Header(rec, ledger.HeaderEventType), ledger.Header(rec, ledger.HeaderTool)).Inc()
			}
		}
	})
}

// TestOldestGauges: the reconciler's gauges of the calls in
// outcome_unknown and of the parked ones, each a count and the age of the
// oldest (0 when none), under the process's role.
func TestOldestGauges(t *testing.T) {
	r := New("reconciler", nil)
	r.Unknown(func() (int, time.Time) { return 0, time.Time{} })
	since := time.Now().Add(-time.Hour)
	r.Parked(func() (int, time.Time) { return 3, since })
	fams, err := r.Gatherer().Gather()
	if err != nil {
		t.Fatal(err)
	}
	got := map[string]float64{}
	for _, f := range fams {
		if !strings.HasPrefix(f.GetName(), "ledger_outcome_unknown_") && !strings.HasPrefix(f.GetName(), "ledger_parked_") {
			continue
		}
		for _, m := range f.GetMetric() {
			if len(m.GetLabel()) != 1 || m.GetLabel()[0].GetValue() != "reconciler" {
				t.Errorf("%s labels %v; want role reconciler alone", f.GetName(), m.GetLabel())
			}
			got[f.GetName()] = m.GetGauge().GetValue()
		}
	}
	if got["ledger_outcome_unknown_calls"] != 0 || got["ledger_outcome_unknown_oldest_age_seconds"] != 0 {
		t.Errorf("outcome_unknown gauges with none: %v; want 0 and 0", got)
	}
	if age := got["ledger_parked_oldest_age_seconds"]; got["ledger_parked_calls"] != 3 || age < 3600 || age > 3700 {
		t.Errorf("parked gauges: %v; want 3 calls, the oldest an hour old", got)
	}
}

// TestServeRolesOfOneProcess: roles sharing a process are served in one
// exposition: a family two roles report is served once with each role's
// series, the runtime's series once, and the own handler's text first.
func TestServeRolesOfOneProcess(t *testing.T) {
	intake, executor := New("intake", nil), New("executor", nil)
	intake.StoreRetried("admit")
	executor.StoreRetried("claim")
	own := http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		fmt.Fprint(w, "# HELP ledger_own_total Own.\n# TYPE ledger_own_total counter\nledger_own_total{role=\"projector\"} 3\n")
	})
	rec := httptest.NewRecorder()
	Serve(own, intake, executor).ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/metrics", nil))
	body := rec.Body.String()
	if !strings.HasPrefix(body, "# HELP ledger_own_total") {
		t.Errorf("the own handler's series are not first:\n%.200s", body)
	}
	parser := expfmt.NewTextParser(model.UTF8Validation)
	fams, err := parser.TextToMetricFamilies(strings.NewReader(body))
	if err != nil || rec.Code != http.StatusOK {
		t.Fatalf("%d, %v; want 200 and an exposition a scraper accepts:\n%s", rec.Code, err, body)
	}
	roles := map[string]string{}
	for _, m := range fams["ledger_store_retries_total"].GetMetric() {
		var role, op string
		for _, l := range m.GetLabel() {
			switch l.GetName() {
			case "role":
				role = l.GetValue()
			case "op":
				op = l.GetValue()
			}
		}
		roles[role] = op
	}
	if want := map[string]string{"intake": "admit", "executor": "claim"}; !cmp.Equal(roles, want) {
		t.Errorf("ledger_store_retries_total by role = %v; want %v", roles, want)
	}
	if n := len(fams["go_goroutines"].GetMetric()); n != 1 {
		t.Errorf("go_goroutines: %d series; want 1", n)
	}
	if _, ok := fams["ledger_own_total"]; !ok {
		t.Errorf("the own handler's family is missing")
	}
}

// TestApprovalQueueSeries: the approval queue's counters and its pending
// gauges are served once ApprovalQueue registered them, and not by a
// registry that did not (another role's).
func TestApprovalQueueSeries(t *testing.T) {
	other := New("executor", nil)
	other.ApprovalDecided("approved")
	if fams, err := other.Gatherer().Gather(); err != nil {
		t.Fatal(err)
	} else {
		for _, f := range fams {
			if strings.HasPrefix(f.GetName(), "ledger_approval") {
				t.Errorf("an executor's registry serves %s", f.GetName())
			}
		}
	}

	r := New("approvals", nil)
	since := time.Now().Add(-time.Hour)
	r.ApprovalQueue(func() (int, time.Time) { return 2, since })
	r.ApprovalDecided("approved")
	r.ApprovalDecided("expired")
	r.ApprovalDecided("expired")
	r.ApprovalAnswered("approve", 200)
	r.ApprovalAnswered("approve", 409)
	r.ApprovalAnswered("approve", 409)
	r.ApprovalsUnpublished(3)
	decisions := map[string]float64{}
	for labels, v := range counters(t, r, "ledger_approval_decisions_total") {
		decisions[labels["decision"]] = v
	}
	if want := map[string]float64{"approved": 1, "expired": 2}; !maps.Equal(decisions, want) {
		t.Errorf("decisions %v; want %v", decisions, want)
	}
	answers := map[string]float64{}
	for labels, v := range counters(t, r, "ledger_approval_requests_total") {
		answers[labels["action"]+"/"+labels["code"]] = v
	}
	if want := map[string]float64{"approve/200": 1, "approve/409": 2}; !maps.Equal(answers, want) {
		t.Errorf("answers %v; want %v", answers, want)
	}
	unpublished := -1.0
	for _, v := range counters(t, r, "ledger_approval_events_unpublished_total") {
		unpublished = v
	}
	if unpublished != 3 {
		t.Errorf("unpublished %v; want 3", unpublished)
	}
	fams, err := r.Gatherer().Gather()
	if err != nil {
		t.Fatal(err)
	}
	gauges := map[string]float64{}
	for _, f := range fams {
		if strings.HasPrefix(f.GetName(), "ledger_approvals_pending") {
			gauges[f.GetName()] = f.GetMetric()[0].GetGauge().GetValue()
		}
	}
	if age := gauges["ledger_approvals_pending_oldest_age_seconds"]; gauges["ledger_approvals_pending"] != 2 || age < 3600 || age > 3700 {
		t.Errorf("pending gauges %v; want 2 approvals, the oldest an hour old", gauges)
	}
}
