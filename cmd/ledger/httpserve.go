package main

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os"
	"sync"
	"time"

	"github.com/spf13/pflag"
	"golang.org/x/sync/errgroup"
)

// httpTLSFlags put TLS, and optionally client certificates, on every HTTP
// server of the binary (the API, the metrics and query address, the
// approval queue, the operators' APIs, the executors' JWKS). They are root
// flags: one role's servers share one certificate.
type httpTLSFlags struct {
	certFile     string
	keyFile      string
	clientCAFile string
}

func (f *httpTLSFlags) register(fs *pflag.FlagSet) {
	fs.StringVar(&f.certFile, "http-tls-cert", "", "PEM certificate (with its chain) of the HTTP servers: with it they serve HTTPS only, TLS 1.2 or later; read again when the file changes, so a rotated certificate needs no restart; needs --http-tls-key")
	fs.StringVar(&f.keyFile, "http-tls-key", "", "PEM private key of --http-tls-cert")
	fs.StringVar(&f.clientCAFile, "http-tls-client-ca", "", "PEM CA certificates: with it, the HTTP servers accept only clients presenting a certificate one of them signed (mutual TLS); read again when the file changes; needs --http-tls-cert")
}

// enabled reports whether the servers speak TLS.
func (f *httpTLSFlags) enabled() bool { return f.certFile != "" || f.keyFile != "" }

// tlsConfig returns the servers' TLS configuration, or nil for plain HTTP.
// It loads every file now, so a wrong flag fails the role at startup.
func (f *httpTLSFlags) tlsConfig(logger *slog.Logger) (*tls.Config, error) {
	switch {
	case f.clientCAFile != "" && f.certFile == "":
		return nil, errors.New("--http-tls-client-ca needs --http-tls-cert and --http-tls-key: client certificates are asked for only over TLS")
	case !f.enabled():
		return nil, nil
	case f.certFile == "":
		return nil, errors.New("--http-tls-key needs --http-tls-cert")
	case f.keyFile == "":
		return nil, errors.New("--http-tls-cert needs --http-tls-key")
	}
	kp := &keyPair{certFile: f.certFile, keyFile: f.keyFile, certFlag: "--http-tls-cert", keyFlag: "--http-tls-key", logger: logger}
	if err := kp.load(); err != nil {
		return nil, err
	}
	cfg := &tls.Config{MinVersion: tls.VersionTLS12, GetCertificate: kp.get}
	if f.clientCAFile == "" {
		return cfg, nil
	}
	cas := &caFile{file: f.clientCAFile, flag: "--http-tls-client-ca", logger: logger}
	if err := cas.load(); err != nil {
		return nil, err
	}
	// Each handshake gets the client CAs of the moment, so that a CA
	// bundle rotated on disk is trusted without a restart. The returned
	// config is the whole of it (GetConfigForClient is not consulted
	// again), so it carries the ALPN protocols http.Server would add.
	cfg.ClientAuth = tls.RequireAndVerifyClientCert
	cfg.GetConfigForClient = func(*tls.ClientHelloInfo) (*tls.Config, error) {
		return &tls.Config{
			MinVersion:     tls.VersionTLS12,
			GetCertificate: kp.get,
			ClientAuth:     tls.RequireAndVerifyClientCert,
			ClientCAs:      cas.get(),
			NextProtos:     []string{"h2", "http/1.1"},
		}, nil
	}
	return cfg, nil
}

// listen opens srv.Addr for srv, over TLS when the flags name a
// certificate, and returns the function that serves srv there until srv is
// closed (returning http.ErrServerClosed then, as ListenAndServe does).
// Every HTTP server of the binary but `ledger dev`'s listens through it.
// Bad TLS flags and an address in use are errors here, before anything
// is served. srv.Addr becomes the bound address (port 0 resolved).
func (f *httpTLSFlags) listen(srv *http.Server, logger *slog.Logger) (serve func() error, err error) {
	cfg, err := f.tlsConfig(logger)
	if err != nil {
		return nil, err
	}
	addr := srv.Addr
	if addr == "" {
		addr = ":http"
		if cfg != nil {
			addr = ":https"
		}
	}
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, err
	}
	srv.Addr = ln.Addr().String()
	if srv.ErrorLog == nil {
		// Refused handshakes (no client certificate, an untrusted CA,
		// plain HTTP) go to the role's log, not to the standard logger.
		srv.ErrorLog = slog.NewLogLogger(logger.Handler(), slog.LevelWarn)
	}
	logger.Info("http server listening", "addr", srv.Addr, "tls", cfg != nil, "client_certificates", cfg != nil && cfg.ClientAuth == tls.RequireAndVerifyClientCert)
	if cfg == nil {
		return func() error { return srv.Serve(ln) }, nil
	}
	srv.TLSConfig = cfg
	// The certificate comes from cfg.GetCertificate, not from files
	// named here.
	return func() error { return srv.ServeTLS(ln, "", "") }, nil
}

// newServer is every HTTP server the ledger runs: h on addr, with bounds
// on how long a client may take to send its request (headers, then the
// whole of it: a body sent a byte at a time would otherwise hold a
// goroutine and a connection for good) and how long an idle keep-alive
// connection is kept. There is no bound here on writing the answer: a CPU
// profile takes as long as it is asked to, and a long poll as long as it
// waits; a handler whose answers may be large bounds their writing
// itself, from when they are ready (httpapi's WriteTimeout).
func newServer(addr string, h http.Handler) *http.Server {
	return &http.Server{
		Addr: addr, Handler: h,
		ReadHeaderTimeout: 5 * time.Second,
		ReadTimeout:       30 * time.Second,
		IdleTimeout:       2 * time.Minute,
	}
}

// serveBackground listens on addr (its errors are returned) and serves h
// until ctx ends, in goroutines the command owns; a server that stops
// before is logged. what names the server in the logs. When ctx ends, the
// requests in progress get shutdownGrace to end (an operator's freeze
// between its write and its publish, say), and then drained is closed:
// what they write with is to be closed after it.
func (g *globals) serveBackground(ctx context.Context, what, addr string, h http.Handler, logger *slog.Logger) (drained <-chan struct{}, err error) {
	srv := newServer(addr, h)
	logger = logger.With("server", what)
	serveHTTP, err := g.httpTLS.listen(srv, logger)
	if err != nil {
		return nil, err
	}
	done := make(chan struct{})
	go func() {
		// Owned by the command: shut down when ctx ends.
		<-ctx.Done()
		shutdown(shutdownGrace, logger, srv)
		close(done)
	}()
	go func() {
		if err := serveHTTP(); !errors.Is(err, http.ErrServerClosed) {
			logger.Error("http server stopped", "err", err)
		}
	}()
	return done, nil
}

// serve listens on addr (bad TLS flags and an address in use are its
// errors, before anything is served), serves h in grp until ctx ends,
// then shuts the server down gracefully (shutdown), calling each of
// onShutdown as it starts to: what ends h's long requests early (their
// answers still written), such as httpapi's EndWaits. It returns the
// bound address.
func (g *globals) serve(ctx context.Context, grp *errgroup.Group, what, addr string, h http.Handler, onShutdown ...func()) (string, error) {
	srv := newServer(addr, h)
	for _, f := range onShutdown {
		srv.RegisterOnShutdown(f)
	}
	logger := g.logger().With("server", what)
	run, err := g.httpTLS.listen(srv, logger)
	if err != nil {
		return "", fmt.Errorf("%s on %s: %w", what, addr, err)
	}
	grp.Go(func() error {
		if err := run(); !errors.Is(err, http.ErrServerClosed) {
			return fmt.Errorf("%s on %s: %w", what, srv.Addr, err)
		}
		return nil
	})
	grp.Go(func() error {
		<-ctx.Done()
		shutdown(shutdownGrace, logger, srv)
		return nil
	})
	return srv.Addr, nil
}

// shutdownGrace is how long a server stopping gives the requests in
// progress to end.
const shutdownGrace = 5 * time.Second

// shutdown stops servers gracefully, all at once: each stops listening,
// and its requests in progress get grace to end; the connections of
// those still running then are closed. That is no error of the process
// (which exits 0, its clients asking again), so it is logged, not
// returned: a process stopping does not wait on its clients.
func shutdown(grace time.Duration, logger *slog.Logger, servers ...*http.Server) {
	ctx, cancel := context.WithTimeout(context.Background(), grace)
	defer cancel()
	var wg sync.WaitGroup
	for _, srv := range servers {
		wg.Go(func() {
			if err := srv.Shutdown(ctx); err != nil {
				logger.Warn("http server requests still running after the shutdown grace; their connections closed", "addr", srv.Addr, "grace", grace, "err", err)
				srv.Close()
			}
		})
	}
	wg.Wait()
}

// keyPair is a certificate and its key, read again from their files on the
// first handshake after either file changed (rotation by cert-manager, a
// mounted secret, or an operator's cp), so a renewed certificate is served
// without a restart. A pair that does not load (a rotation caught between
// its two writes) leaves the last good one in use until the files change
// again.
type keyPair struct {
	certFile, keyFile string
	// certFlag and keyFlag name the files in errors and logs.
	certFlag, keyFlag string
	logger            *slog.Logger

	mu   sync.Mutex
	cert *tls.Certificate
	// certStat and keyStat describe the files as last read (or last
	// tried), to see a change with two stats per handshake.
	certStat, keyStat os.FileInfo
}

// load reads the pair, and fails if it is unreadable or does not match.
func (k *keyPair) load() error {
	cs, ks, err := k.stat()
	if err != nil {
		return err
	}
	cert, err := k.read()
	if err != nil {
		return err
	}
	k.mu.Lock()
	defer k.mu.Unlock()
	k.cert, k.certStat, k.keyStat = cert, cs, ks
	return nil
}

func (k *keyPair) stat() (cert, key os.FileInfo, err error) {
	if cert, err = os.Stat(k.certFile); err != nil {
		return nil, nil, fmt.Errorf("%s: %w", k.certFlag, err)
	}
	if key, err = os.Stat(k.keyFile); err != nil {
		return nil, nil, fmt.Errorf("%s: %w", k.keyFlag, err)
	}
	return cert, key, nil
}

func (k *keyPair) read() (*tls.Certificate, error) {
	certPEM, err := os.ReadFile(k.certFile)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", k.certFlag, err)
	}
	keyPEM, err := os.ReadFile(k.keyFile)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", k.keyFlag, err)
	}
	cert, err := tls.X509KeyPair(certPEM, keyPEM)
	if err != nil {
		// Its errors name what is wrong, never the key's bytes.
		return nil, fmt.Errorf("%s %s and %s %s: %w", k.certFlag, k.certFile, k.keyFlag, k.keyFile, err)
	}
	return &cert, nil
}

// get is the servers' tls.Config.GetCertificate.
func (k *keyPair) get(*tls.ClientHelloInfo) (*tls.Certificate, error) { return k.current(), nil }

// getClient is the clients' tls.Config.GetClientCertificate.
func (k *keyPair) getClient(*tls.CertificateRequestInfo) (*tls.Certificate, error) {
	return k.current(), nil
}

// current is the pair of the moment: read again if either file changed.
func (k *keyPair) current() *tls.Certificate {
	k.mu.Lock()
	defer k.mu.Unlock()
	cs, ks, err := k.stat()
	if err != nil || (sameFile(cs, k.certStat) && sameFile(ks, k.keyStat)) {
		// A file gone for a moment (a secret's symlinks swapped) is
		// not a reason to fail handshakes: use the last good pair.
		return k.cert
	}
	k.certStat, k.keyStat = cs, ks
	cert, err := k.read()
	if err != nil {
		k.logger.Warn("tls certificate not reloaded, still using the previous one", "cert_file", k.certFile, "key_file", k.keyFile, "err", err)
		return k.cert
	}
	k.cert = cert
	if cert.Leaf != nil {
		k.logger.Info("tls certificate reloaded", "cert_file", k.certFile, "not_after", cert.Leaf.NotAfter)
	}
	return k.cert
}

// caFile is a PEM bundle of CA certificates, read again on the first
// handshake after the file changed (a CA rotated by cert-manager or an
// operator). A bundle that does not load leaves the last good one in use.
type caFile struct {
	file, flag string
	logger     *slog.Logger

	mu   sync.Mutex
	pool *x509.CertPool
	stat os.FileInfo
}

// load reads the bundle, and fails if it is unreadable or holds no
// certificate.
func (c *caFile) load() error {
	st, err := os.Stat(c.file)
	if err != nil {
		return fmt.Errorf("%s: %w", c.flag, err)
	}
	pool, err := c.read()
	if err != nil {
		return err
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	c.pool, c.stat = pool, st
	return nil
}

func (c *caFile) read() (*x509.CertPool, error) {
	pem, err := os.ReadFile(c.file)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", c.flag, err)
	}
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(pem) {
		return nil, fmt.Errorf("%s %s holds no PEM certificate", c.flag, c.file)
	}
	return pool, nil
}

// get returns the CAs of the moment.
func (c *caFile) get() *x509.CertPool {
	c.mu.Lock()
	defer c.mu.Unlock()
	st, err := os.Stat(c.file)
	if err != nil || sameFile(st, c.stat) {
		return c.pool
	}
	c.stat = st
	pool, err := c.read()
	if err != nil {
		c.logger.Warn("tls CA bundle not reloaded, still using the previous one", "file", c.file, "err", err)
		return c.pool
	}
	c.pool = pool
	c.logger.Info("tls CA bundle reloaded", "file", c.file)
	return c.pool
}

// sameFile reports whether a and b are the same file, unmodified.
func sameFile(a, b os.FileInfo) bool {
	return os.SameFile(a, b) && a.ModTime().Equal(b.ModTime()) && a.Size() == b.Size()
}
