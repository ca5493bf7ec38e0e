package loadtest

import (
	"bytes"
	"context"
	"strings"
	"testing"
	"time"
)

func TestCoreSpeed(t *testing.T) {
	// A core of any machine this runs on signs thousands a second, and
	// none signs a billion.
	if got := CoreSpeed(t.Context(), 50*time.Millisecond); got < 100 || got > 1e9 {
		t.Errorf("CoreSpeed = %v signatures/s; want a reading in [100, 1e9]", got)
	}
	ctx, cancel := context.WithCancel(t.Context())
	cancel()
	if got := CoreSpeed(ctx, time.Hour); got != 0 {
		t.Errorf("CoreSpeed with its context done = %v; want 0, at once", got)
	}
}

// The machine line carries the host's speed where it was read, and says
// nothing of it where it was not.
func TestMachineLineSpeed(t *testing.T) {
	for _, tc := range []struct {
		start, end float64
		want       string
	}{
		{0, 0, ""},
		{41234.4, 0, "; one core signs 41234 Ed25519/s\n"},
		{41234.4, 39876.6, "; one core signs 41234 Ed25519/s at the start, 39877 at the end\n"},
	} {
		var buf bytes.Buffer
		rep := Report{Machine: Machine{CPU: "AMD EPYC", Cores: 2, SignsPerSecStart: tc.start, SignsPerSecEnd: tc.end}}
		if err := rep.WriteTable(&buf); err != nil {
			t.Fatal(err)
		}
		line, _, _ := strings.Cut(buf.String(), "\n")
		if got := strings.Contains(line, "Ed25519"); got != (tc.want != "") {
			t.Errorf("machine line %q with speeds %v, %v; want the speed shown: %v", line, tc.start, tc.end, tc.want != "")
		}
		if tc.want != "" && !strings.HasSuffix(line+"\n", tc.want) {
			t.Errorf("machine line %q; want it to end with %q", line, tc.want)
		}
	}
}
