package credentials

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"strings"
)

// ErrNoSecret: the keystore holds no secret under the name.
var ErrNoSecret = errors.New("credentials: no such secret in the keystore")

// secretName is what a secret may be called: a file name, nothing more.
var secretName = regexp.MustCompile(`^[A-Za-z0-9_.-]{1,128}$`)

// Keystore holds the long-lived secrets of tool backends (third-party API
// keys): one file per secret in a directory, readable by the owner only.
// They are read when needed and handed only to the tool adapter; a
// Keystore never prints them.
type Keystore struct{ dir string }

// NewKeystore returns the keystore in dir.
func NewKeystore(dir string) *Keystore { return &Keystore{dir: dir} }

// Secret returns the secret called name. The file must not be readable by
// group or others.
func (k *Keystore) Secret(name string) (string, error) {
	if k == nil || k.dir == "" {
		return "", ErrNoSecret
	}
	if !secretName.MatchString(name) {
		return "", fmt.Errorf("%w: bad name", ErrNoSecret)
	}
	path := filepath.Join(k.dir, name)
	st, err := os.Stat(path)
	if errors.Is(err, os.ErrNotExist) {
		return "", fmt.Errorf("%w: %s", ErrNoSecret, name)
	}
	if err != nil {
		return "", fmt.Errorf("credentials: keystore: %v", err)
	}
	if st.Mode().Perm()&0o077 != 0 {
		return "", fmt.Errorf("credentials: secret %s is open to other users (mode %#o); it must be 0600", name, st.Mode().Perm())
	}
	b, err := os.ReadFile(path)
	if err != nil {
		return "", fmt.Errorf("credentials: keystore: %v", err)
	}
	return strings.TrimSpace(string(b)), nil
}

// String never shows a secret.
func (k *Keystore) String() string { return "credentials.Keystore(" + k.dir + ")" }
