package metrics

import "testing"

// TestStoreRetried: each retry the store reports is counted under its
// operation and the process's role.
func TestStoreRetried(t *testing.T) {
	r := New("executor")
	r.StoreRetried("claim")
	r.StoreRetried("claim")
	r.StoreRetried("complete")
	fams, err := r.Gatherer().Gather()
	if err != nil {
		t.Fatal(err)
	}
	got := map[string]float64{}
	for _, f := range fams {
		if f.GetName() != "ledger_store_retries_total" {
			continue
		}
		for _, m := range f.GetMetric() {
			labels := map[string]string{}
			for _, l := range m.GetLabel() {
				labels[l.GetName()] = l.GetValue()
			}
			if labels["role"] != "executor" {
				t.Errorf("series %v; want role executor", labels)
			}
			got[labels["op"]] = m.GetCounter().GetValue()
		}
	}
	if got["claim"] != 2 || got["complete"] != 1 || len(got) != 2 {
		t.Errorf("ledger_store_retries_total by op = %v; want claim 2, complete 1", got)
	}
}
