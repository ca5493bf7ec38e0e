package credentials

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func TestKeystore(t *testing.T) {
	dir := t.TempDir()
	const canary = "canary-keystore-secret"
	if err := os.WriteFile(filepath.Join(dir, "api_key"), []byte(canary+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "open"), []byte(canary), 0o644); err != nil {
		t.Fatal(err)
	}
	k := NewKeystore(dir)
	if got, err := k.Secret("api_key"); err != nil || got != canary {
		t.Errorf("Secret(api_key) = %q, %v; want the file's secret", got, err)
	}
	for _, tc := range []struct{ name, want string }{
		{"missing", "no such secret"},
		{"../api_key", "no such secret"},
		{"open", "open to other users"},
	} {
		_, err := k.Secret(tc.name)
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("Secret(%q) = %v; want an error saying %q", tc.name, err, tc.want)
		}
		if err != nil && strings.Contains(err.Error(), canary) {
			t.Errorf("Secret(%q) error quotes the secret: %v", tc.name, err)
		}
	}
	if _, err := (*Keystore)(nil).Secret("api_key"); !errors.Is(err, ErrNoSecret) {
		t.Errorf("nil keystore: %v; want ErrNoSecret", err)
	}
	if s := fmt.Sprintf("%v %+v", k, k); strings.Contains(s, canary) {
		t.Errorf("the keystore prints a secret: %s", s)
	}
}
