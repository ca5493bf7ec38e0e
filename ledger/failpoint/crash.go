//go:build failpoints

package failpoint

import (
	"fmt"
	"math/rand/v2"
	"os"
	"syscall"
	"time"
)

// Enabled reports whether this binary was built with the `failpoints` tag.
const Enabled = true

// FromEnv returns the hook that crashes this process at role's armed
// failpoints (EnvSpec), each with its probability, or nil when none is
// armed. A crash appends a line to the EnvLog file, if set, then sends
// SIGKILL to this process: no deferred function, flush or shutdown runs,
// as when a machine dies.
func FromEnv(role string) (Hook, error) {
	v, ok := os.LookupEnv(EnvSpec)
	if !ok || v == "" {
		return nil, nil
	}
	spec, err := ParseSpec(v)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", EnvSpec, err)
	}
	probs := spec.For(role)
	if len(probs) == 0 {
		return nil, nil
	}
	logPath := os.Getenv(EnvLog)
	return func(n Name) {
		p := probs[n]
		if p <= 0 || rand.Float64() >= p {
			return
		}
		if logPath != "" {
			// One write of one line to an O_APPEND file: lines of
			// several processes never interleave.
			if fh, err := os.OpenFile(logPath, os.O_WRONLY|os.O_APPEND|os.O_CREATE, 0o644); err == nil {
				fmt.Fprintf(fh, "%s %s %d %d\n", role, n, os.Getpid(), time.Now().UnixNano())
				fh.Close()
			}
		}
		_ = syscall.Kill(os.Getpid(), syscall.SIGKILL)
		// SIGKILL cannot be caught; wait for it to land.
		select {}
	}, nil
}
