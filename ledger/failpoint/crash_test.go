//go:build failpoints

package failpoint

import (
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
)

// TestCrash runs this test binary again with a failpoint armed at
// probability 1 and checks that the child died of SIGKILL at the point,
// after logging it, and not before.
func TestCrash(t *testing.T) {
	if os.Getenv("FAILPOINT_TEST_CHILD") == "1" {
		h, err := FromEnv("executor")
		if err != nil {
			os.Exit(3)
		}
		h.Hit(Consumed) // not armed for this role: passes
		os.Stdout.WriteString("before\n")
		h.Hit(Claimed)
		os.Stdout.WriteString("after\n")
		os.Exit(0)
	}
	logPath := filepath.Join(t.TempDir(), "crashes.log")
	cmd := exec.Command(os.Args[0], "-test.run", "^TestCrash$")
	cmd.Env = append(os.Environ(), "FAILPOINT_TEST_CHILD=1", EnvSpec+"=executor.claimed=1,intake.consumed=1", EnvLog+"="+logPath)
	out, err := cmd.Output()
	ws, ok := cmd.ProcessState.Sys().(syscall.WaitStatus)
	if err == nil || !ok || !ws.Signaled() || ws.Signal() != syscall.SIGKILL {
		t.Fatalf("child: err %v, status %v; want killed by SIGKILL", err, cmd.ProcessState)
	}
	if got := string(out); !strings.Contains(got, "before") || strings.Contains(got, "after") {
		t.Errorf("child output %q: want it to die between before and after", got)
	}
	line, err := os.ReadFile(logPath)
	if err != nil {
		t.Fatal(err)
	}
	if f := strings.Fields(string(line)); len(f) != 4 || f[0] != "executor" || f[1] != string(Claimed) {
		t.Errorf("crash log %q: want `executor claimed <pid> <time>`", line)
	}
}
