package main

import (
	"bytes"
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"golang.org/x/sync/errgroup"

	"github.com/toolcall-ledger/ledger/ledger"
	"github.com/toolcall-ledger/ledger/ledger/ledgertest"
	"github.com/toolcall-ledger/ledger/projections/callindex"
	"github.com/toolcall-ledger/ledger/projections/chstore/chtest"
	"github.com/toolcall-ledger/ledger/projections/httpapi"
)

// startHTTP serves h through f.listen on a free loopback port until t
// ends, and returns the address.
func startHTTP(t *testing.T, f httpTLSFlags, logger *slog.Logger, h http.Handler) string {
	t.Helper()
	if logger == nil {
		logger = slog.New(slog.DiscardHandler)
	}
	srv := &http.Server{Addr: "127.0.0.1:0", Handler: h, ReadHeaderTimeout: 5 * time.Second}
	serve, err := f.listen(srv, logger)
	if err != nil {
		t.Fatalf("listen(%+v) = %v", f, err)
	}
	done := make(chan error, 1)
	go func() { done <- serve() }()
	t.Cleanup(func() {
		srv.Close()
		if err := <-done; !errors.Is(err, http.ErrServerClosed) {
			t.Errorf("serve() = %v; want http.ErrServerClosed", err)
		}
	})
	return srv.Addr
}

// hello answers with the client certificate's common name, or "hello"
// without one.
var hello = http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
	if r.TLS != nil && len(r.TLS.PeerCertificates) > 0 {
		fmt.Fprint(w, "hello "+r.TLS.PeerCertificates[0].Subject.CommonName)
		return
	}
	fmt.Fprint(w, "hello")
})

// httpsClient trusts roots and presents certs; one connection per request,
// so that each request sees the server's certificate of the moment.
func httpsClient(roots *x509.CertPool, certs ...tls.Certificate) *http.Client {
	return &http.Client{
		Timeout: 10 * time.Second,
		Transport: &http.Transport{
			TLSClientConfig:   &tls.Config{RootCAs: roots, Certificates: certs},
			DisableKeepAlives: true,
		},
	}
}

// fetch returns the body of a 200 answer, or an error.
func fetch(hc *http.Client, url string) (string, *http.Response, error) {
	resp, err := hc.Get(url)
	if err != nil {
		return "", nil, err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		return "", nil, err
	}
	if resp.StatusCode != http.StatusOK {
		return string(b), resp, fmt.Errorf("status %d: %s", resp.StatusCode, b)
	}
	return string(b), resp, nil
}

// TestServeHTTPPlain: without the flags, servers speak plain HTTP as
// before.
func TestServeHTTPPlain(t *testing.T) {
	addr := startHTTP(t, httpTLSFlags{}, nil, hello)
	if body, _, err := fetch(http.DefaultClient, "http://"+addr+"/"); err != nil || body != "hello" {
		t.Errorf("GET http://%s = %q, %v; want hello", addr, body, err)
	}
}

// TestHTTPTLSServe: with a certificate, the server answers HTTPS clients
// that trust its CA, over TLS 1.2 or later, and nobody else.
func TestHTTPTLSServe(t *testing.T) {
	pki := ledgertest.NewPKI(t)
	pair := pki.Server("api")
	addr := startHTTP(t, httpTLSFlags{certFile: pair.CertFile, keyFile: pair.KeyFile}, nil, hello)

	body, resp, err := fetch(httpsClient(pki.Pool), "https://"+addr+"/")
	if err != nil || body != "hello" {
		t.Fatalf("GET https://%s = %q, %v; want hello", addr, body, err)
	}
	if resp.TLS == nil || resp.TLS.Version < tls.VersionTLS12 {
		t.Errorf("connection state %+v; want TLS 1.2 or later", resp.TLS)
	} else if got, want := resp.TLS.PeerCertificates[0].SerialNumber, pair.Cert.Leaf.SerialNumber; got.Cmp(want) != 0 {
		t.Errorf("server certificate serial %v; want %v (--http-tls-cert's)", got, want)
	}

	// Plain HTTP gets no answer from the handler.
	if body, _, err := fetch(http.DefaultClient, "http://"+addr+"/"); err == nil || body == "hello" {
		t.Errorf("plain GET http://%s = %q, %v; want an error", addr, body, err)
	}
	// A client that does not trust the CA refuses the server.
	var unknown x509.UnknownAuthorityError
	if _, _, err := fetch(httpsClient(ledgertest.NewPKI(t).Pool), "https://"+addr+"/"); !errors.As(err, &unknown) {
		t.Errorf("GET with another CA's roots: %v; want x509.UnknownAuthorityError", err)
	}
	// TLS 1.1 is below the server's minimum.
	old := &http.Client{Timeout: 10 * time.Second, Transport: &http.Transport{TLSClientConfig: &tls.Config{
		RootCAs: pki.Pool, MinVersion: tls.VersionTLS10, MaxVersion: tls.VersionTLS11,
	}}}
	if _, _, err := fetch(old, "https://"+addr+"/"); err == nil {
		t.Errorf("GET over TLS 1.1 succeeded; want the handshake refused")
	}
}

// TestHTTPTLSClientCA: with --http-tls-client-ca, only clients presenting
// a certificate that CA signed are served.
func TestHTTPTLSClientCA(t *testing.T) {
	pki := ledgertest.NewPKI(t)
	pair := pki.Server("api")
	addr := startHTTP(t, httpTLSFlags{certFile: pair.CertFile, keyFile: pair.KeyFile, clientCAFile: pki.CAFile}, nil, hello)
	url := "https://" + addr + "/"

	if body, _, err := fetch(httpsClient(pki.Pool), url); err == nil {
		t.Errorf("GET without a client certificate = %q; want refused", body)
	}
	stranger := ledgertest.NewPKI(t).Client("stranger", "u_stranger")
	if body, _, err := fetch(httpsClient(pki.Pool, stranger.Cert), url); err == nil {
		t.Errorf("GET with another CA's client certificate = %q; want refused", body)
	}
	// A server certificate of the right CA is not a client certificate.
	if body, _, err := fetch(httpsClient(pki.Pool, pki.Server("other").Cert), url); err == nil {
		t.Errorf("GET presenting a server-auth certificate = %q; want refused", body)
	}
	client := pki.Client("ops", "u_ops")
	if body, _, err := fetch(httpsClient(pki.Pool, client.Cert), url); err != nil || body != "hello u_ops" {
		t.Errorf("GET with the CA's client certificate = %q, %v; want hello u_ops", body, err)
	}
}

// TestHTTPTLSRotation: a certificate replaced on disk is served from the
// next handshake, without a restart; a replacement caught half-written
// (the new certificate beside the old key) keeps the last good one in
// service, and is logged.
func TestHTTPTLSRotation(t *testing.T) {
	pki := ledgertest.NewPKI(t)
	dir := t.TempDir()
	certFile, keyFile := filepath.Join(dir, "tls.crt"), filepath.Join(dir, "tls.key")
	// The files change at most once per step, each time with a later
	// mtime, as on any file system whatever its timestamp granularity.
	mtime := time.Now()
	install := func(t *testing.T, pair ledgertest.Pair, cert, key bool) {
		t.Helper()
		for _, f := range []struct {
			do       bool
			src, dst string
		}{{cert, pair.CertFile, certFile}, {key, pair.KeyFile, keyFile}} {
			if !f.do {
				continue
			}
			b, err := os.ReadFile(f.src)
			if err != nil {
				t.Fatal(err)
			}
			if err := os.WriteFile(f.dst, b, 0o600); err != nil {
				t.Fatal(err)
			}
			mtime = mtime.Add(time.Second)
			if err := os.Chtimes(f.dst, mtime, mtime); err != nil {
				t.Fatal(err)
			}
		}
	}
	first, second, third := pki.Server("first"), pki.Server("second"), pki.Server("third")
	install(t, first, true, true)
	logs := &ledgertest.LogBuffer{}
	addr := startHTTP(t, httpTLSFlags{certFile: certFile, keyFile: keyFile}, slog.New(slog.NewTextHandler(logs, nil)), hello)
	hc := httpsClient(pki.Pool)
	served := func(t *testing.T, want ledgertest.Pair, name string) {
		t.Helper()
		_, resp, err := fetch(hc, "https://"+addr+"/")
		if err != nil {
			t.Fatalf("GET after %s: %v", name, err)
		}
		if got := resp.TLS.PeerCertificates[0].SerialNumber; got.Cmp(want.Cert.Leaf.SerialNumber) != 0 {
			t.Errorf("after %s the server presents serial %v; want %v", name, got, want.Cert.Leaf.SerialNumber)
		}
	}
	served(t, first, "start")

	install(t, second, true, true)
	served(t, second, "rotating to the second certificate")

	install(t, third, true, false)
	served(t, second, "writing only the third certificate, not its key")
	if !strings.Contains(logs.String(), "tls certificate not reloaded") {
		t.Errorf("no warning logged for a certificate that does not match its key; log:\n%s", logs)
	}
	install(t, third, false, true)
	served(t, third, "writing the third key too")
}

// TestHTTPTLSConfigErrors: wrong TLS flags fail at startup, naming the
// flag, and never quote the key.
func TestHTTPTLSConfigErrors(t *testing.T) {
	pki := ledgertest.NewPKI(t)
	pair, other := pki.Server("api"), pki.Server("other")
	dir := t.TempDir()
	garbage := filepath.Join(dir, "garbage.pem")
	if err := os.WriteFile(garbage, []byte("not a certificate\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	missing := filepath.Join(dir, "missing.pem")
	keyPEM, err := os.ReadFile(pair.KeyFile)
	if err != nil {
		t.Fatal(err)
	}
	// A run of the key's base64, past its PEM header.
	keyBody := string(bytes.Split(keyPEM, []byte("\n"))[1])
	tests := []struct {
		name string
		f    httpTLSFlags
		want string
	}{
		{"cert without key", httpTLSFlags{certFile: pair.CertFile}, "--http-tls-cert needs --http-tls-key"},
		{"key without cert", httpTLSFlags{keyFile: pair.KeyFile}, "--http-tls-key needs --http-tls-cert"},
		{"client CA without cert", httpTLSFlags{clientCAFile: pki.CAFile}, "--http-tls-client-ca needs --http-tls-cert"},
		{"missing cert", httpTLSFlags{certFile: missing, keyFile: pair.KeyFile}, "--http-tls-cert: stat " + missing},
		{"missing key", httpTLSFlags{certFile: pair.CertFile, keyFile: missing}, "--http-tls-key: stat " + missing},
		{"unreadable cert", httpTLSFlags{certFile: dir, keyFile: pair.KeyFile}, "--http-tls-cert: read " + dir},
		{"cert not PEM", httpTLSFlags{certFile: garbage, keyFile: pair.KeyFile}, "--http-tls-cert " + garbage},
		{"key of another certificate", httpTLSFlags{certFile: pair.CertFile, keyFile: other.KeyFile}, "private key does not match"},
		{"cert given as key", httpTLSFlags{certFile: pair.CertFile, keyFile: pair.CertFile}, "--http-tls-key " + pair.CertFile},
		{"missing client CA", httpTLSFlags{certFile: pair.CertFile, keyFile: pair.KeyFile, clientCAFile: missing}, "--http-tls-client-ca: stat " + missing},
		{"client CA not PEM", httpTLSFlags{certFile: pair.CertFile, keyFile: pair.KeyFile, clientCAFile: garbage}, "--http-tls-client-ca " + garbage + " holds no PEM certificate"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			srv := &http.Server{Addr: "127.0.0.1:0", Handler: hello}
			serve, err := tc.f.listen(srv, slog.New(slog.DiscardHandler))
			if err == nil {
				srv.Close()
				_ = serve()
				t.Fatalf("listen(%+v) = nil error; want one containing %q", tc.f, tc.want)
			}
			if !strings.Contains(err.Error(), tc.want) {
				t.Errorf("listen(%+v) = %q; want it to contain %q", tc.f, err, tc.want)
			}
			if strings.Contains(err.Error(), keyBody) {
				t.Errorf("listen(%+v) = %q; it quotes the private key", tc.f, err)
			}
		})
	}
}

// TestHTTPTLSProjectorEnv runs the real `ledger projector` configured
// only through LEDGER_* variables, TLS and mutual TLS included, and checks
// that its /healthz is served over TLS to a client with a certificate, and
// to nobody else, and its /metrics.
func TestHTTPTLSProjectorEnv(t *testing.T) {
	dsn, db := chtest.DSN(t), chtest.FreshDatabase(t)
	k := ledgertest.New(t, ledgertest.Options{Partitions: 2})
	cli(t, "projector", "migrate", "--clickhouse-dsn", dsn, "--clickhouse-database", db)

	pki := ledgertest.NewPKI(t)
	pair := pki.Server("projector")
	addr := freeAddr(t)
	for name, v := range map[string]string{
		"LEDGER_KAFKA_BROKERS":       strings.Join(k.Client.Brokers, ","),
		"LEDGER_TOPIC_REQUESTS":      k.Topics.Requests,
		"LEDGER_TOPIC_EVENTS":        k.Topics.Events,
		"LEDGER_TOPIC_CONTROL":       k.Topics.Control,
		"LEDGER_TOPIC_DLQ":           k.Topics.DLQ,
		"LEDGER_GROUP":               k.Group("projector-tls"),
		"LEDGER_CLICKHOUSE_DSN":      dsn,
		"LEDGER_CLICKHOUSE_DATABASE": db,
		"LEDGER_METRICS_ADDR":        addr,
		"LEDGER_HTTP_TLS_CERT":       pair.CertFile,
		"LEDGER_HTTP_TLS_KEY":        pair.KeyFile,
		"LEDGER_HTTP_TLS_CLIENT_CA":  pki.CAFile,
		"LEDGER_LOG_LEVEL":           "warn",
	} {
		t.Setenv(name, v)
	}
	exited := runCommand(t, "projector")

	url := "https://" + addr + "/healthz"
	withCert := httpsClient(pki.Pool, pki.Client("monitor", "u_monitor").Cert)
	ledgertest.WaitFor(t, 30*time.Second, func() error {
		exited()
		body, _, err := fetch(withCert, url)
		if err != nil {
			return err
		}
		if strings.TrimSpace(body) != "ok" {
			return fmt.Errorf("healthz = %q; want ok", body)
		}
		return nil
	})
	if body, _, err := fetch(httpsClient(pki.Pool), url); err == nil {
		t.Errorf("healthz without a client certificate = %q; want refused", body)
	}
	// Its metrics carry role, as the other roles' do, and the runtime's
	// and the process's series follow them.
	body, _, err := fetch(withCert, "https://"+addr+"/metrics")
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{`ledger_projector_written_records_total{role="projector"}`, "\ngo_goroutines ", "\nprocess_resident_memory_bytes "} {
		if !strings.Contains(body, want) {
			t.Errorf("the projector's /metrics lacks %q", want)
		}
	}
	if body, _, err := fetch(http.DefaultClient, "http://"+addr+"/healthz"); err == nil {
		t.Errorf("healthz over plain HTTP = %q; want an error", body)
	}
}

// TestDevRefusesHTTPTLS: ledger dev serves plain HTTP only, so it refuses
// the TLS flags rather than ignore them.
func TestDevRefusesHTTPTLS(t *testing.T) {
	root := newRoot()
	root.SetArgs([]string{"dev", "--data-dir", t.TempDir(), "--http-tls-cert", "cert.pem", "--http-tls-key", "key.pem"})
	root.SetOut(io.Discard)
	root.SetErr(io.Discard)
	err := root.ExecuteContext(t.Context())
	if err == nil || !strings.Contains(err.Error(), "plain HTTP") {
		t.Fatalf("ledger dev with --http-tls-cert: %v; want a refusal naming plain HTTP", err)
	}
}

// TestServersBounded: every HTTP server the ledger runs bounds how long a
// client may take over its request and how long an idle connection is
// kept (a body withheld, or sent a byte at a time, held a goroutine and a
// connection for good with only the headers bounded), that is, every one
// is made by newServer.
func TestServersBounded(t *testing.T) {
	srv := newServer("127.0.0.1:0", hello)
	if srv.ReadHeaderTimeout <= 0 || srv.ReadTimeout <= 0 || srv.IdleTimeout <= 0 {
		t.Errorf("newServer: ReadHeaderTimeout %v, ReadTimeout %v, IdleTimeout %v; want all set", srv.ReadHeaderTimeout, srv.ReadTimeout, srv.IdleTimeout)
	}
	files, err := filepath.Glob("*.go")
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range files {
		if strings.HasSuffix(f, "_test.go") {
			continue
		}
		src, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		// Server literals, not slices of servers.
		n := strings.Count(string(src), "http.Server{") - strings.Count(string(src), "[]*http.Server{")
		if f != "httpserve.go" && n > 0 || f == "httpserve.go" && n != 1 {
			t.Errorf("%s builds %d http.Server literals; build servers with newServer", f, n)
		}
	}
}

// signalPublisher tells published of each publish, and publishes nothing.
type signalPublisher struct{ published chan struct{} }

func (p signalPublisher) Publish(context.Context, []byte, []byte) error {
	p.published <- struct{}{}
	return nil
}

// noCalls knows no call: a wait on it runs out.
type noCalls struct{}

func (noCalls) Call(context.Context, ledger.CallKey) (callindex.Call, error) {
	return callindex.Call{}, callindex.ErrNotFound
}

// TestServeEndsLongPolls: stopping ledger api while an agent's POST
// ?wait=30s is in progress answers the agent as a wait that ran out (202
// with the status URL), at once, and serve ends without an error. Before,
// the wait held the shutdown past its 5 s grace: serve returned context
// deadline exceeded (the process exited 1) and the agent's connection
// was cut as the process exited.
func TestServeEndsLongPolls(t *testing.T) {
	pub := signalPublisher{published: make(chan struct{}, 1)}
	api, err := httpapi.New(httpapi.Config{Publisher: pub, Calls: noCalls{}})
	if err != nil {
		t.Fatal(err)
	}
	g := &globals{logLevel: "error"}
	ctx, stop := context.WithCancel(t.Context())
	defer stop()
	var grp errgroup.Group
	addr, err := g.serve(ctx, &grp, "api", "127.0.0.1:0", api, api.EndWaits)
	if err != nil {
		t.Fatal(err)
	}
	type answer struct {
		status int
		body   map[string]string
		err    error
	}
	hash, err := ledger.ArgumentsHash("t_a", "get_weather", 1, map[string]any{"city": "Oslo"})
	if err != nil {
		t.Fatal(err)
	}
	env := `{"tool":"get_weather","tool_version":1,"call_id":"c1","arguments":{"city":"Oslo"},"scope":{"tenant_id":"t_a"},"idempotency_key":"k1","arguments_hash":"` + hash + `"}`
	answered := make(chan answer, 1)
	go func() {
		resp, err := http.Post("http://"+addr+"/v1/calls?wait=30s", "application/json", strings.NewReader(env))
		if err != nil {
			answered <- answer{err: err}
			return
		}
		defer resp.Body.Close()
		var a answer
		a.status, a.err = resp.StatusCode, json.NewDecoder(resp.Body).Decode(&a.body)
		answered <- a
	}()
	select {
	case <-pub.published: // the wait follows the publish
	case a := <-answered:
		t.Fatalf("POST ?wait=30s answered %d %v, %v before publishing", a.status, a.body, a.err)
	case <-time.After(10 * time.Second):
		t.Fatal("POST ?wait=30s: nothing published in 10s")
	}
	stop()
	stopped := make(chan error, 1)
	go func() { stopped <- grp.Wait() }()
	select {
	case err := <-stopped:
		if err != nil {
			t.Errorf("serve ended with %v; want nil", err)
		}
	case <-time.After(shutdownGrace / 2):
		t.Fatalf("serve still running %v after it was stopped; want the wait ended at once", shutdownGrace/2)
	}
	a := <-answered
	if a.err != nil || a.status != http.StatusAccepted || a.body["status_url"] == "" {
		t.Errorf("the waiting agent got %d %v, %v; want 202 with a status_url", a.status, a.body, a.err)
	}
}

// TestServeShutdownClosesWhatOutlastsGrace: a request still running when the
// shutdown grace runs out has its connection closed, and shutdown
// returns. Before, serve returned Shutdown's context deadline exceeded,
// leaving the connection open, and the process exited 1.
func TestServeShutdownClosesWhatOutlastsGrace(t *testing.T) {
	started, release := make(chan struct{}), make(chan struct{})
	defer close(release)
	srv := newServer("127.0.0.1:0", http.HandlerFunc(func(http.ResponseWriter, *http.Request) {
		close(started)
		<-release // as a handler that ignores the shutdown
	}))
	logger := slog.New(slog.DiscardHandler)
	serve, err := (&httpTLSFlags{}).listen(srv, logger)
	if err != nil {
		t.Fatal(err)
	}
	served := make(chan error, 1)
	go func() { served <- serve() }()
	answered := make(chan error, 1)
	go func() {
		resp, err := http.Get("http://" + srv.Addr + "/")
		if err == nil {
			resp.Body.Close()
		}
		answered <- err
	}()
	<-started
	done := make(chan struct{})
	go func() {
		shutdown(100*time.Millisecond, logger, srv)
		close(done)
	}()
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		t.Fatal("shutdown still running 10s on; want it done after its 100ms grace")
	}
	select {
	case err := <-answered:
		if err == nil {
			t.Error("the request outlasting the grace was answered; want its connection closed")
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the request outlasting the grace still holds its connection 10s on; want it closed")
	}
	if err := <-served; !errors.Is(err, http.ErrServerClosed) {
		t.Errorf("serve() = %v; want http.ErrServerClosed", err)
	}
}

// A request read whole runs past the server's read timeout with its
// context live: ReadTimeout bounds reading the request, and a wait (the
// API's ?wait=, up to 30 s, the same as the timeout) or a profile is not
// cut short by it. (net/http lifts the read deadline once it has read the
// request and starts its background read; a server option or a wrapper
// that kept it would cancel the request's context at the deadline.)
func TestRequestReadWholeOutlivesTheReadTimeout(t *testing.T) {
	const read = 200 * time.Millisecond
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if _, err := io.ReadAll(r.Body); err != nil {
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		select {
		case <-time.After(3 * read):
			fmt.Fprint(w, "live")
		case <-r.Context().Done():
			fmt.Fprint(w, "cancelled")
		}
	})
	srv := newServerReading("127.0.0.1:0", h, read)
	serve, err := (&httpTLSFlags{}).listen(srv, slog.New(slog.DiscardHandler))
	if err != nil {
		t.Fatal(err)
	}
	go func() { _ = serve() }()
	t.Cleanup(func() { srv.Close() })
	for _, tc := range []struct{ method, body string }{
		{http.MethodGet, ""},
		{http.MethodPost, `{"envelope":"read whole"}`},
	} {
		req, err := http.NewRequestWithContext(t.Context(), tc.method, "http://"+srv.Addr+"/", strings.NewReader(tc.body))
		if err != nil {
			t.Fatal(err)
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if string(b) != "live" {
			t.Errorf("%s running past the read timeout: %q; want live", tc.method, b)
		}
	}
}
