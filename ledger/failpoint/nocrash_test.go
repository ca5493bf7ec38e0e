//go:build !failpoints

package failpoint

import "testing"

func TestFromEnvRefusesWithoutTag(t *testing.T) {
	t.Setenv(EnvSpec, "")
	if h, err := FromEnv("executor"); h != nil || err != nil {
		t.Errorf("unarmed: hook %v, err %v; want nil, nil", h != nil, err)
	}
	t.Setenv(EnvSpec, "claimed=1")
	if _, err := FromEnv("executor"); err == nil {
		t.Error("armed in a build without failpoints: no error")
	}
}
