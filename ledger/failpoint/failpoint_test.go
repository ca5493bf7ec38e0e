package failpoint

import (
	"testing"

	"github.com/google/go-cmp/cmp"
)

func TestParseSpec(t *testing.T) {
	spec, err := ParseSpec(" executor.claimed=0.5, consumed=0.25,intake.consumed=1,")
	if err != nil {
		t.Fatal(err)
	}
	if diff := cmp.Diff(map[Name]float64{Claimed: 0.5, Consumed: 0.25}, spec.For("executor")); diff != "" {
		t.Errorf("executor (-want +got):\n%s", diff)
	}
	if diff := cmp.Diff(map[Name]float64{Consumed: 1}, spec.For("intake")); diff != "" {
		t.Errorf("intake: its own probability wins (-want +got):\n%s", diff)
	}
	for _, bad := range []string{"claimed", "claimed=2", "claimed=-0.1", "claimed=x", "executor.no-such-point=0.1"} {
		if _, err := ParseSpec(bad); err == nil {
			t.Errorf("ParseSpec(%q): no error", bad)
		}
	}
}

func TestNilHookDoesNothing(t *testing.T) {
	var h Hook
	h.Hit(Claimed) // must not panic
	var got []Name
	h = func(n Name) { got = append(got, n) }
	h.Hit(Produced)
	if diff := cmp.Diff([]Name{Produced}, got); diff != "" {
		t.Errorf("hits (-want +got):\n%s", diff)
	}
}
