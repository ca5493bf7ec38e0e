// Package tlsfiles keeps a TLS certificate and its key, or a bundle of CA
// certificates, as their PEM files say now: read at start, and read again
// when their content changes, so that a certificate renewed or a CA
// rotated on disk (cert-manager, a Secret volume updated in place, an
// operator's cp) is used from the next handshake without a restart. Files
// that change but do not load (a renewal caught between the writes of its
// two files) leave the last good value in use, with a warning.
//
// The HTTP servers and clients of cmd/ledger and the Kafka clients of
// package ledger share it.
package tlsfiles

import (
	"bytes"
	"context"
	"crypto/sha256"
	"crypto/tls"
	"crypto/x509"
	"encoding/pem"
	"fmt"
	"log/slog"
	"os"
	"sync"
	"time"
)

// File is a PEM file and what it goes by in errors and logs: the flag or
// the configuration field that named it.
type File struct {
	Path string
	Name string
}

// Config says how often files are looked at again and where their reloads
// are logged. The zero value looks at every use and logs nothing.
type Config struct {
	// Every is how long a value is used before its files are looked at
	// again. Default 0: at every use, that is every handshake, so that a
	// rotation is seen at once. A file looked at is read whole and
	// hashed; a client that dials often may want a second or so.
	Every time.Duration
	// Logger gets an Info when the files are reloaded, and a Warn when
	// they changed but do not load: once per failure (another error, or
	// other content), not at every look. Default: nothing is logged.
	Logger Logger
}

// Logger is where reloads are logged. *slog.Logger is one.
type Logger interface {
	Log(ctx context.Context, level slog.Level, msg string, args ...any)
}

// Error is a file, or a pair of files, that did not load. Its message
// names the files, by Name and path, and never quotes their content.
type Error struct {
	// Name is the Name of the file at fault; for a certificate and a key
	// that do not make a pair, the certificate's.
	Name string
	// Reason says what is wrong, naming the files by path; "" for a file
	// that could not be read, which Err says.
	Reason string
	// Err is the underlying error, if any: a *fs.PathError for a file
	// that could not be read (errors.Is(err, fs.ErrNotExist) works), or
	// crypto/tls's for a pair that does not parse, which describes PEM
	// blocks and never the key.
	Err error
}

// Error returns the name, the reason and the underlying error.
func (e *Error) Error() string {
	s := e.Name
	if e.Reason != "" {
		s += " " + e.Reason
	}
	if e.Err != nil {
		s += ": " + e.Err.Error()
	}
	return s
}

// Unwrap returns the underlying error.
func (e *Error) Unwrap() error { return e.Err }

// Pair is a certificate (with its chain) and its private key, from two
// PEM files. It is safe for concurrent use.
type Pair struct {
	w *watched[*tls.Certificate]
}

// LoadPair reads cert and key now, and fails with an *Error if either
// cannot be read or they do not make a pair: a wrong setting fails at
// start-up. Afterwards they are read again as cfg says.
func LoadPair(cert, key File, cfg Config) (*Pair, error) {
	parse := func(pems [][]byte) (*tls.Certificate, error) {
		for i, f := range []File{cert, key} {
			if cut(pems[i]) {
				return nil, &Error{Name: f.Name, Reason: f.Path + " ends inside a PEM block (written in part)"}
			}
		}
		pair, err := tls.X509KeyPair(pems[0], pems[1])
		if err != nil {
			return nil, &Error{Name: cert.Name, Reason: fmt.Sprintf("%s and %s %s are not a certificate and its key", cert.Path, key.Name, key.Path), Err: err}
		}
		return &pair, nil
	}
	w, err := load(cfg, "certificate", parse, []File{cert, key}, "cert_file", cert.Path, "key_file", key.Path)
	if err != nil {
		return nil, err
	}
	w.loaded = func(c *tls.Certificate) []any {
		if c.Leaf == nil {
			return nil
		}
		return []any{"not_after", c.Leaf.NotAfter}
	}
	return &Pair{w: w}, nil
}

// Certificate returns the pair of the moment.
func (p *Pair) Certificate() *tls.Certificate { return p.w.get() }

// GetCertificate is a server's tls.Config.GetCertificate: the pair of the
// moment, whatever the client asked for.
func (p *Pair) GetCertificate(*tls.ClientHelloInfo) (*tls.Certificate, error) {
	return p.w.get(), nil
}

// GetClientCertificate is a client's tls.Config.GetClientCertificate: the
// pair of the moment, asked for only when the server requests one.
func (p *Pair) GetClientCertificate(*tls.CertificateRequestInfo) (*tls.Certificate, error) {
	return p.w.get(), nil
}

// Pool is a bundle of CA certificates from one PEM file. It is safe for
// concurrent use.
type Pool struct {
	w *watched[*x509.CertPool]
}

// LoadPool reads ca now, and fails with an *Error if it cannot be read or
// holds no PEM certificate. Afterwards it is read again as cfg says.
func LoadPool(ca File, cfg Config) (*Pool, error) {
	parse := func(pems [][]byte) (*x509.CertPool, error) {
		if cut(pems[0]) {
			return nil, &Error{Name: ca.Name, Reason: ca.Path + " ends inside a PEM block (written in part)"}
		}
		pool := x509.NewCertPool()
		if !pool.AppendCertsFromPEM(pems[0]) {
			return nil, &Error{Name: ca.Name, Reason: ca.Path + " holds no PEM certificate"}
		}
		return pool, nil
	}
	w, err := load(cfg, "CA bundle", parse, []File{ca}, "file", ca.Path)
	if err != nil {
		return nil, err
	}
	return &Pool{w: w}, nil
}

// CertPool returns the CAs of the moment, for a tls.Config's RootCAs or
// ClientCAs. The pool returned is not changed afterwards.
func (p *Pool) CertPool() *x509.CertPool { return p.w.get() }

// watched is a value parsed from files, and parsed again when their
// content changes. The content is compared by digest rather than by the
// files' size and modification time: a rewrite of the same size within
// the file system's timestamp granularity, or a copy that keeps the old
// time (cp -p, rsync -t, tar), changes neither, and would be missed.
type watched[T any] struct {
	cfg   Config
	what  string // for logs: "certificate", "CA bundle"
	files []File
	attrs []any // the files, for logs
	parse func([][]byte) (T, error)
	// loaded, if set, adds attributes to the log of a reload.
	loaded func(T) []any

	mu      sync.Mutex
	val     T
	sum     [sha256.Size]byte // of the content val was parsed from
	checked time.Time
	// failed is the failure last logged, "" when the files load: the
	// error and the digest of the content that failed (zero if it could
	// not be read), so that the same failure is logged, and the same
	// content parsed, once.
	failed    string
	failedSum [sha256.Size]byte
}

func load[T any](cfg Config, what string, parse func([][]byte) (T, error), files []File, attrs ...any) (*watched[T], error) {
	w := &watched[T]{cfg: cfg, what: what, files: files, attrs: attrs, parse: parse}
	pems, sum, err := w.read()
	if err != nil {
		return nil, err
	}
	if w.val, err = parse(pems); err != nil {
		return nil, err
	}
	w.sum, w.checked = sum, time.Now()
	return w, nil
}

// read returns the files' content and its digest.
func (w *watched[T]) read() ([][]byte, [sha256.Size]byte, error) {
	h := sha256.New()
	pems := make([][]byte, len(w.files))
	for i, f := range w.files {
		// Stat first, so that a missing file is reported as
		// "stat <path>: no such file or directory", as the ledger's
		// TLS settings always have.
		if _, err := os.Stat(f.Path); err != nil {
			return nil, [sha256.Size]byte{}, &Error{Name: f.Name, Err: err}
		}
		b, err := os.ReadFile(f.Path)
		if err != nil {
			return nil, [sha256.Size]byte{}, &Error{Name: f.Name, Err: err}
		}
		// Each file's length first, so that bytes moved from one file
		// to the other change the digest.
		fmt.Fprintf(h, "%d:", len(b))
		h.Write(b)
		pems[i] = b
	}
	return pems, [sha256.Size]byte(h.Sum(nil)), nil
}

// get returns the value of the moment: parsed again if the files' content
// changed since it was parsed, looked at if cfg.Every has passed since
// the last look.
func (w *watched[T]) get() T {
	w.mu.Lock()
	defer w.mu.Unlock()
	now := time.Now()
	if w.cfg.Every > 0 && now.Sub(w.checked) < w.cfg.Every {
		return w.val
	}
	w.checked = now
	pems, sum, err := w.read()
	switch {
	case err == nil && sum == w.sum:
		// Unchanged, or back to what is in use.
		w.failed = ""
		return w.val
	case err == nil && w.failed != "" && sum == w.failedSum:
		// The content that failed last time, failing again.
		return w.val
	}
	var val T
	if err == nil {
		val, err = w.parse(pems)
	}
	if err != nil {
		// A file gone for a moment (a secret's symlinks swapped), or
		// a renewal half-written, is no reason to fail handshakes.
		if msg := err.Error(); msg != w.failed || sum != w.failedSum {
			w.failed, w.failedSum = msg, sum
			w.log(slog.LevelWarn, "tls "+w.what+" not reloaded, still using the previous one", "err", err)
		}
		return w.val
	}
	w.val, w.sum, w.failed = val, sum, ""
	var extra []any
	if w.loaded != nil {
		extra = w.loaded(val)
	}
	w.log(slog.LevelInfo, "tls "+w.what+" reloaded", extra...)
	return w.val
}

// log logs msg with the files' attributes and args, if there is a logger.
func (w *watched[T]) log(level slog.Level, msg string, args ...any) {
	if w.cfg.Logger == nil {
		return
	}
	// No context: a reload is no request's, and a handshake's context
	// carries nothing for the log.
	w.cfg.Logger.Log(context.Background(), level, msg, append(append([]any(nil), w.attrs...), args...)...)
}

// cut reports whether b ends inside a PEM block: a file read while it was
// being written. crypto/tls and crypto/x509 stop quietly at such a block
// and take the blocks before it, so a chain caught without its
// intermediate, or a bundle without its last CA, would load as good. A
// file caught between two blocks reads as a whole file of fewer blocks,
// which nothing tells from one: write such files whole and rename them
// into place (as a Secret volume's update does), or a chain may be used
// without its last blocks until the next look.
func cut(b []byte) bool {
	for {
		block, rest := pem.Decode(b)
		if block == nil {
			return bytes.Contains(b, []byte("-----BEGIN"))
		}
		b = rest
	}
}
