package main

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"sync"
	"time"

	"github.com/spf13/pflag"
	"golang.org/x/sync/errgroup"

	"github.com/toolcall-ledger/ledger/ledger/tlsfiles"
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
	// The files are looked at on every handshake (tlsfiles.Config's
	// default), so that a rotation is served from the next one.
	reload := tlsfiles.Config{Logger: logger}
	kp, err := tlsfiles.LoadPair(tlsfiles.File{Path: f.certFile, Name: "--http-tls-cert"}, tlsfiles.File{Path: f.keyFile, Name: "--http-tls-key"}, reload)
	if err != nil {
		return nil, err
	}
	cfg := &tls.Config{MinVersion: tls.VersionTLS12, GetCertificate: kp.GetCertificate}
	if f.clientCAFile == "" {
		return cfg, nil
	}
	cas, err := tlsfiles.LoadPool(tlsfiles.File{Path: f.clientCAFile, Name: "--http-tls-client-ca"}, reload)
	if err != nil {
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
			GetCertificate: kp.GetCertificate,
			ClientAuth:     tls.RequireAndVerifyClientCert,
			ClientCAs:      cas.CertPool(),
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
	return newServerReading(addr, h, 30*time.Second)
}

// newServerReading is newServer with read as its bound on reading a
// request whole.
func newServerReading(addr string, h http.Handler, read time.Duration) *http.Server {
	return &http.Server{
		Addr: addr, Handler: h,
		ReadHeaderTimeout: 5 * time.Second,
		ReadTimeout:       read,
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
