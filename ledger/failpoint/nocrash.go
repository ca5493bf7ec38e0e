//go:build !failpoints

package failpoint

import (
	"fmt"
	"os"
)

// Enabled reports whether this binary was built with the `failpoints` tag.
const Enabled = false

// FromEnv returns nil: this binary was built without the `failpoints` tag
// and cannot crash itself. It refuses an armed EnvSpec rather than ignore
// it, so that a fault run against the wrong binary does not pass by
// injecting nothing.
func FromEnv(string) (Hook, error) {
	if v := os.Getenv(EnvSpec); v != "" {
		return nil, fmt.Errorf("%s is set but this binary was built without failpoints (go build -tags failpoints)", EnvSpec)
	}
	return nil, nil
}
