package tlsfiles_test

import (
	"bytes"
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/toolcall-ledger/ledger/ledger/ledgertest"
	"github.com/toolcall-ledger/ledger/ledger/tlsfiles"
)

// logRecorder is a tlsfiles.Logger that keeps what it is given, as text.
type logRecorder struct {
	mu    sync.Mutex
	lines []string
}

func (r *logRecorder) Log(_ context.Context, level slog.Level, msg string, args ...any) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.lines = append(r.lines, fmt.Sprintf("%s %s %v", level, msg, args))
}

// count is how many lines logged at level contain s.
func (r *logRecorder) count(level slog.Level, s string) int {
	r.mu.Lock()
	defer r.mu.Unlock()
	n := 0
	for _, l := range r.lines {
		if strings.HasPrefix(l, level.String()+" ") && strings.Contains(l, s) {
			n++
		}
	}
	return n
}

func (r *logRecorder) String() string {
	r.mu.Lock()
	defer r.mu.Unlock()
	return strings.Join(r.lines, "\n")
}

// write puts b at path in place.
func write(t *testing.T, path string, b []byte) {
	t.Helper()
	if err := os.WriteFile(path, b, 0o600); err != nil {
		t.Fatal(err)
	}
}

// install copies the files of pair over cert and key.
func install(t *testing.T, pair ledgertest.Pair, cert, key tlsfiles.File) {
	t.Helper()
	write(t, cert.Path, ledgertest.ReadFile(t, pair.CertFile))
	write(t, key.Path, ledgertest.ReadFile(t, pair.KeyFile))
}

// pairFiles is a certificate file and a key file, named --cert and --key,
// in a directory of t's, holding first.
func pairFiles(t *testing.T, first ledgertest.Pair) (cert, key tlsfiles.File) {
	t.Helper()
	dir := t.TempDir()
	cert = tlsfiles.File{Path: filepath.Join(dir, "tls.crt"), Name: "--cert"}
	key = tlsfiles.File{Path: filepath.Join(dir, "tls.key"), Name: "--key"}
	install(t, first, cert, key)
	return cert, key
}

// noKeyMaterial fails t if s quotes a PEM file or one of the keys.
func noKeyMaterial(t *testing.T, what, s string, keys ...ledgertest.Pair) {
	t.Helper()
	quotes := []string{"BEGIN", "PRIVATE KEY"}
	for _, k := range keys {
		quotes = append(quotes, string(ledgertest.ReadFile(t, k.KeyFile)[40:80]))
	}
	for _, q := range quotes {
		if strings.Contains(s, q) {
			t.Errorf("%s quotes key material (%q):\n%s", what, q, s)
		}
	}
}

// isPair fails t unless got is want's certificate.
func isPair(t *testing.T, step string, got *tls.Certificate, want ledgertest.Pair) {
	t.Helper()
	if got == nil || !bytes.Equal(got.Certificate[0], want.Cert.Certificate[0]) {
		t.Errorf("%s: the pair in use is not %s's", step, filepath.Base(want.CertFile))
	}
}

// A pair rewritten in place is used from the next look; one caught
// half-written (the new certificate beside the old key) leaves the last
// good one in use, with one warning, which quotes no key.
func TestPairRotation(t *testing.T) {
	pki := ledgertest.NewPKI(t)
	a, b, c := pki.Client("a", "a"), pki.Client("b", "b"), pki.Client("c", "c")
	cert, key := pairFiles(t, a)
	logs := &logRecorder{}
	p, err := tlsfiles.LoadPair(cert, key, tlsfiles.Config{Logger: logs})
	if err != nil {
		t.Fatal(err)
	}
	isPair(t, "at start", p.Certificate(), a)

	install(t, b, cert, key)
	isPair(t, "after the rotation to b", p.Certificate(), b)
	if n := logs.count(slog.LevelInfo, "tls certificate reloaded"); n != 1 {
		t.Errorf("%d reloads logged after the rotation to b; want 1\n%s", n, logs)
	}

	write(t, cert.Path, ledgertest.ReadFile(t, c.CertFile))
	for range 3 {
		isPair(t, "with c's certificate beside b's key", p.Certificate(), b)
	}
	if n := logs.count(slog.LevelWarn, "tls certificate not reloaded, still using the previous one"); n != 1 {
		t.Errorf("%d warnings logged for a half-written pair looked at 3 times; want 1\n%s", n, logs)
	}
	if got := logs.String(); !strings.Contains(got, cert.Path) || !strings.Contains(got, key.Path) {
		t.Errorf("the warning does not name the files %s and %s:\n%s", cert.Path, key.Path, got)
	}

	// Another half-written pair is another failure, logged again.
	write(t, cert.Path, ledgertest.ReadFile(t, a.CertFile))
	isPair(t, "with a's certificate beside b's key", p.Certificate(), b)
	if n := logs.count(slog.LevelWarn, "not reloaded"); n != 2 {
		t.Errorf("%d warnings logged after a second half-written pair; want 2\n%s", n, logs)
	}

	// c's chain caught written in part (its leaf whole, the next block
	// cut), beside its key: crypto/tls would take the leaf alone.
	write(t, key.Path, ledgertest.ReadFile(t, c.KeyFile))
	ca := ledgertest.ReadFile(t, pki.CAFile)
	write(t, cert.Path, append(ledgertest.ReadFile(t, c.CertFile), ca[:len(ca)/2]...))
	isPair(t, "with c's chain written in part", p.Certificate(), b)
	if n := logs.count(slog.LevelWarn, "written in part"); n != 1 {
		t.Errorf("%d warnings saying the chain was written in part; want 1\n%s", n, logs)
	}

	install(t, c, cert, key)
	isPair(t, "with c's key written too", p.Certificate(), c)
	noKeyMaterial(t, "the log", logs.String(), a, b, c)
}

// padded is b with trailing new lines to n bytes, which PEM parsers skip.
func padded(t *testing.T, b []byte, n int) []byte {
	t.Helper()
	if len(b) > n {
		t.Fatalf("padded: %d bytes is more than %d", len(b), n)
	}
	return append(b, bytes.Repeat([]byte("\n"), n-len(b))...)
}

// A rewrite that leaves the file's size and modification time as they
// were is seen: the content is compared, not the file's metadata.
func TestSameSizeSameTimeRewrite(t *testing.T) {
	first, second := ledgertest.NewPKI(t), ledgertest.NewPKI(t)
	ca1, ca2 := ledgertest.ReadFile(t, first.CAFile), ledgertest.ReadFile(t, second.CAFile)
	size := max(len(ca1), len(ca2))
	path := filepath.Join(t.TempDir(), "ca.pem")
	write(t, path, padded(t, ca1, size))
	st, err := os.Stat(path)
	if err != nil {
		t.Fatal(err)
	}
	pool, err := tlsfiles.LoadPool(tlsfiles.File{Path: path, Name: "--ca"}, tlsfiles.Config{})
	if err != nil {
		t.Fatal(err)
	}
	if !pool.CertPool().Equal(first.Pool) {
		t.Fatalf("the pool at start is not the first CA's")
	}

	write(t, path, padded(t, ca2, size))
	if err := os.Chtimes(path, st.ModTime(), st.ModTime()); err != nil {
		t.Fatal(err)
	}
	if now, err := os.Stat(path); err != nil || now.Size() != st.Size() || !now.ModTime().Equal(st.ModTime()) {
		t.Fatalf("the rewrite changed the file's size or time (%v); the test means to keep both", err)
	}
	if !pool.CertPool().Equal(second.Pool) {
		t.Errorf("after a same-size rewrite with the old time, the pool is not the second CA's")
	}
}

// A CA bundle that cannot be read or holds no certificate leaves the last
// good pool in use, with a warning; a good one is used again at once.
func TestPoolKeepsLastGood(t *testing.T) {
	first, second := ledgertest.NewPKI(t), ledgertest.NewPKI(t)
	dir := t.TempDir()
	path := filepath.Join(dir, "ca.pem")
	write(t, path, ledgertest.ReadFile(t, first.CAFile))
	logs := &logRecorder{}
	pool, err := tlsfiles.LoadPool(tlsfiles.File{Path: path, Name: "--ca"}, tlsfiles.Config{Logger: logs})
	if err != nil {
		t.Fatal(err)
	}
	good := pool.CertPool()

	for _, tc := range []struct {
		name  string
		spoil func(t *testing.T)
	}{
		{"removed", func(*testing.T) {}},
		{"a directory", func(t *testing.T) {
			if err := os.Mkdir(path, 0o700); err != nil {
				t.Fatal(err)
			}
		}},
		{"not PEM", func(t *testing.T) { write(t, path, []byte("not a certificate\n")) }},
		{"a key", func(t *testing.T) {
			write(t, path, ledgertest.ReadFile(t, first.Client("x", "x").KeyFile))
		}},
		// Another CA whole, then this one's cut: x509 would take the
		// other alone.
		{"cut inside its second CA", func(t *testing.T) {
			ca := ledgertest.ReadFile(t, first.CAFile)
			write(t, path, append(ledgertest.ReadFile(t, second.CAFile), ca[:len(ca)/2]...))
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			// Each case starts from no file at all.
			if err := os.RemoveAll(path); err != nil {
				t.Fatal(err)
			}
			tc.spoil(t)
			warned := logs.count(slog.LevelWarn, "tls CA bundle not reloaded, still using the previous one")
			if got := pool.CertPool(); got != good {
				t.Errorf("the pool with the bundle %s is not the last good one", tc.name)
			}
			if n := logs.count(slog.LevelWarn, "tls CA bundle not reloaded, still using the previous one"); n != warned+1 {
				t.Errorf("%d warnings logged for the bundle %s; want 1\n%s", n-warned, tc.name, logs)
			}
			if !strings.Contains(logs.String(), path) {
				t.Errorf("the warning does not name %s:\n%s", path, logs)
			}
		})
	}
	noKeyMaterial(t, "the log", logs.String())

	_ = os.RemoveAll(path)
	write(t, path, ledgertest.ReadFile(t, second.CAFile))
	if !pool.CertPool().Equal(second.Pool) {
		t.Errorf("after a good bundle was written again, the pool is not its CA's")
	}
}

// With Config.Every, the files are looked at no more often; without it,
// at every use.
func TestEvery(t *testing.T) {
	pki := ledgertest.NewPKI(t)
	a, b := pki.Client("a", "a"), pki.Client("b", "b")
	cert, key := pairFiles(t, a)
	hourly, err := tlsfiles.LoadPair(cert, key, tlsfiles.Config{Every: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	always, err := tlsfiles.LoadPair(cert, key, tlsfiles.Config{})
	if err != nil {
		t.Fatal(err)
	}
	install(t, b, cert, key)
	isPair(t, "looked at hourly, just after the load", hourly.Certificate(), a)
	isPair(t, "looked at every use", always.Certificate(), b)
	got, err := always.GetCertificate(&tls.ClientHelloInfo{})
	if err != nil {
		t.Fatal(err)
	}
	isPair(t, "GetCertificate", got, b)
}

// Files that do not load fail LoadPair and LoadPool with an *Error that
// names the file at fault, wraps the cause and quotes no key.
func TestLoadErrors(t *testing.T) {
	pki := ledgertest.NewPKI(t)
	pair, other := pki.Client("a", "a"), pki.Client("b", "b")
	dir := t.TempDir()
	missing := filepath.Join(dir, "missing.pem")
	garbage := filepath.Join(dir, "garbage.pem")
	write(t, garbage, []byte("not a certificate\n"))
	f := func(path, name string) tlsfiles.File { return tlsfiles.File{Path: path, Name: name} }
	for _, tc := range []struct {
		name     string
		load     func() error
		wantName string
		contains []string
		is       error
	}{
		{
			name: "missing certificate",
			load: func() error {
				_, err := tlsfiles.LoadPair(f(missing, "--cert"), f(pair.KeyFile, "--key"), tlsfiles.Config{})
				return err
			},
			wantName: "--cert", contains: []string{"--cert: stat " + missing}, is: fs.ErrNotExist,
		},
		{
			name: "missing key",
			load: func() error {
				_, err := tlsfiles.LoadPair(f(pair.CertFile, "--cert"), f(missing, "--key"), tlsfiles.Config{})
				return err
			},
			wantName: "--key", contains: []string{"--key: stat " + missing}, is: fs.ErrNotExist,
		},
		{
			name: "certificate is a directory",
			load: func() error {
				_, err := tlsfiles.LoadPair(f(dir, "--cert"), f(pair.KeyFile, "--key"), tlsfiles.Config{})
				return err
			},
			wantName: "--cert", contains: []string{"--cert: read " + dir},
		},
		{
			name: "key of another certificate",
			load: func() error {
				_, err := tlsfiles.LoadPair(f(pair.CertFile, "--cert"), f(other.KeyFile, "--key"), tlsfiles.Config{})
				return err
			},
			wantName: "--cert", contains: []string{"--cert " + pair.CertFile, "--key " + other.KeyFile, "private key does not match"},
		},
		{
			name: "certificate given as key",
			load: func() error {
				_, err := tlsfiles.LoadPair(f(pair.CertFile, "--cert"), f(pair.CertFile, "--key"), tlsfiles.Config{})
				return err
			},
			wantName: "--cert", contains: []string{"--key " + pair.CertFile},
		},
		{
			name:     "missing CA",
			load:     func() error { _, err := tlsfiles.LoadPool(f(missing, "--ca"), tlsfiles.Config{}); return err },
			wantName: "--ca", contains: []string{"--ca: stat " + missing}, is: fs.ErrNotExist,
		},
		{
			name:     "CA not PEM",
			load:     func() error { _, err := tlsfiles.LoadPool(f(garbage, "--ca"), tlsfiles.Config{}); return err },
			wantName: "--ca", contains: []string{"--ca " + garbage + " holds no PEM certificate"},
		},
		{
			name:     "CA is a key",
			load:     func() error { _, err := tlsfiles.LoadPool(f(pair.KeyFile, "--ca"), tlsfiles.Config{}); return err },
			wantName: "--ca", contains: []string{"--ca " + pair.KeyFile + " holds no PEM certificate"},
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := tc.load()
			fe, ok := errors.AsType[*tlsfiles.Error](err)
			if !ok {
				t.Fatalf("got %v (%T); want a *tlsfiles.Error", err, err)
			}
			if fe.Name != tc.wantName {
				t.Errorf("got Name %q; want %q (%v)", fe.Name, tc.wantName, err)
			}
			for _, s := range tc.contains {
				if !strings.Contains(err.Error(), s) {
					t.Errorf("got %q; want it to contain %q", err, s)
				}
			}
			if tc.is != nil && !errors.Is(err, tc.is) {
				t.Errorf("got %v; want it to wrap %v", err, tc.is)
			}
			noKeyMaterial(t, "the error", err.Error(), pair, other)
		})
	}
}

// Handshakes may look at the files from many goroutines while they are
// rewritten: each gets a whole pair, the last good or the new one.
func TestConcurrentRotation(t *testing.T) {
	pki := ledgertest.NewPKI(t)
	a, b := pki.Client("a", "a"), pki.Client("b", "b")
	cert, key := pairFiles(t, a)
	p, err := tlsfiles.LoadPair(cert, key, tlsfiles.Config{Logger: &logRecorder{}})
	if err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	stop := make(chan struct{})
	for range 4 {
		wg.Go(func() {
			for {
				select {
				case <-stop:
					return
				default:
				}
				got := p.Certificate()
				if !bytes.Equal(got.Certificate[0], a.Cert.Certificate[0]) && !bytes.Equal(got.Certificate[0], b.Cert.Certificate[0]) {
					t.Errorf("a handshake got a pair that is neither a's nor b's")
					return
				}
			}
		})
	}
	pairs := []ledgertest.Pair{a, b}
	for i := range 20 {
		install(t, pairs[i%2], cert, key)
	}
	close(stop)
	wg.Wait()
	install(t, b, cert, key)
	isPair(t, "after the rotations", p.Certificate(), b)
}
