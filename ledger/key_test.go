package ledger

import "testing"

func TestApprovalIDRoundTrip(t *testing.T) {
	for _, k := range []CallKey{{"t_a", "k"}, {"t_b", "run_42:step/7"}, {"t", "ü ✓"}} {
		id := k.ApprovalID()
		got, err := ParseApprovalID(id)
		if err != nil || got != k {
			t.Errorf("ParseApprovalID(%q) = %v, %v; want %v", id, got, err, k)
		}
	}
	for _, bad := range []string{"", "apr_", "x_dF9h", "apr_!!!", "apr_" + "bm9zbGFzaA"} {
		if _, err := ParseApprovalID(bad); err == nil {
			t.Errorf("ParseApprovalID(%q) accepted", bad)
		}
	}
}
