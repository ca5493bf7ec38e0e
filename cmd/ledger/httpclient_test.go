package main

import (
	"bytes"
	"context"
	"crypto/x509"
	"encoding/json"
	"errors"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/toolcall-ledger/ledger/ledger/ledgertest"
	"github.com/toolcall-ledger/ledger/processors/credentials"
	"github.com/toolcall-ledger/ledger/processors/demobackend"
	"github.com/toolcall-ledger/ledger/processors/httptool"
)

// rotatingFiles stands for files an operator or cert-manager replaces in
// place: each install gives them a later mtime, as on any file system
// whatever its timestamp granularity.
type rotatingFiles struct {
	dir   string
	mtime time.Time
}

func newRotatingFiles(t *testing.T) *rotatingFiles {
	return &rotatingFiles{dir: t.TempDir(), mtime: time.Now()}
}

// install copies src over the file name in r's directory and returns its
// path.
func (r *rotatingFiles) install(t *testing.T, src, name string) string {
	t.Helper()
	b, err := os.ReadFile(src)
	if err != nil {
		t.Fatal(err)
	}
	dst := filepath.Join(r.dir, name)
	if err := os.WriteFile(dst, b, 0o600); err != nil {
		t.Fatal(err)
	}
	r.mtime = r.mtime.Add(time.Second)
	if err := os.Chtimes(dst, r.mtime, r.mtime); err != nil {
		t.Fatal(err)
	}
	return dst
}

// getFresh fetches url with a new connection (idle ones closed first), so that
// each request makes a handshake of its own.
func getFresh(t *testing.T, hc *http.Client, url string) (string, error) {
	t.Helper()
	hc.CloseIdleConnections()
	body, _, err := fetch(hc, url)
	return body, err
}

// TestHTTPClientMutualTLS: with --http-client-cert, --http-client-key and
// --http-client-ca, the ledger's HTTP clients reach a server that requires
// client certificates and is served by a private CA, and still check that
// server as crypto/tls does: its CA, its name.
func TestHTTPClientMutualTLS(t *testing.T) {
	pki := ledgertest.NewPKI(t)
	server := pki.Server("approvals")
	client := pki.Client("api", "ledger-api")
	url := "https://" + startHTTP(t, httpTLSFlags{certFile: server.CertFile, keyFile: server.KeyFile, clientCAFile: pki.CAFile}, nil, hello) + "/"
	logger := slog.New(slog.DiscardHandler)

	full := httpClientFlags{certFile: client.CertFile, keyFile: client.KeyFile, caFile: pki.CAFile}
	hc, err := full.client(logger, 10*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	body, resp, err := fetch(hc, url)
	if err != nil || body != "hello ledger-api" {
		t.Fatalf("GET with the client flags = %q, %v; want hello ledger-api", body, err)
	}
	// Both sides offer HTTP/2 (the server's config is made per
	// handshake, the client's per connection), as without the flags.
	if resp.ProtoMajor != 2 {
		t.Errorf("GET with the client flags spoke %s; want HTTP/2", resp.Proto)
	}

	// Without a client certificate the server refuses; without the CA
	// the client refuses the server.
	caOnly, err := (&httpClientFlags{caFile: pki.CAFile}).client(logger, 10*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	if body, err := getFresh(t, caOnly, url); err == nil {
		t.Errorf("GET without --http-client-cert = %q; want the handshake refused", body)
	}
	certOnly, err := (&httpClientFlags{certFile: client.CertFile, keyFile: client.KeyFile}).client(logger, 10*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	var unknown x509.UnknownAuthorityError
	if _, err := getFresh(t, certOnly, url); !errors.As(err, &unknown) {
		t.Errorf("GET without --http-client-ca: %v; want x509.UnknownAuthorityError (the system's roots)", err)
	}

	// A server of another CA, and a server of the right CA under another
	// name, are refused.
	stranger := ledgertest.NewPKI(t).Server("stranger")
	strangerURL := "https://" + startHTTP(t, httpTLSFlags{certFile: stranger.CertFile, keyFile: stranger.KeyFile}, nil, hello) + "/"
	if body, err := getFresh(t, hc, strangerURL); !errors.As(err, &unknown) {
		t.Errorf("GET of another CA's server = %q, %v; want x509.UnknownAuthorityError", body, err)
	}
	misnamed := pki.Server("misnamed", "approvals.example")
	misnamedURL := "https://" + startHTTP(t, httpTLSFlags{certFile: misnamed.CertFile, keyFile: misnamed.KeyFile}, nil, hello) + "/"
	var hostname x509.HostnameError
	if body, err := getFresh(t, hc, misnamedURL); !errors.As(err, &hostname) {
		t.Errorf("GET of 127.0.0.1 presenting a certificate for approvals.example = %q, %v; want x509.HostnameError", body, err)
	}
}

// TestHTTPClientRotation: the client's certificate and CA bundle, and the
// server's client CA bundle, replaced on disk, are used from the next
// connection without a restart; a half-written replacement keeps the last
// good one.
func TestHTTPClientRotation(t *testing.T) {
	oldCA, newCA := ledgertest.NewPKI(t), ledgertest.NewPKI(t)
	files := newRotatingFiles(t)
	serverCAs := files.install(t, oldCA.CAFile, "server-client-ca.pem")
	clientCAs := files.install(t, oldCA.CAFile, "client-ca.pem")
	first := oldCA.Client("first", "first")
	certFile := files.install(t, first.CertFile, "tls.crt")
	keyFile := files.install(t, first.KeyFile, "tls.key")

	logs := &ledgertest.LogBuffer{}
	logger := slog.New(slog.NewTextHandler(logs, nil))
	// Two servers require client certificates of the CAs in serverCAs:
	// one of the old CA's, one of the new CA's.
	oldServer, newServer := oldCA.Server("old"), newCA.Server("new")
	oldURL := "https://" + startHTTP(t, httpTLSFlags{certFile: oldServer.CertFile, keyFile: oldServer.KeyFile, clientCAFile: serverCAs}, logger, hello) + "/"
	newURL := "https://" + startHTTP(t, httpTLSFlags{certFile: newServer.CertFile, keyFile: newServer.KeyFile, clientCAFile: serverCAs}, logger, hello) + "/"

	hc, err := (&httpClientFlags{certFile: certFile, keyFile: keyFile, caFile: clientCAs}).client(logger, 10*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	if body, err := getFresh(t, hc, oldURL); err != nil || body != "hello first" {
		t.Fatalf("GET at start = %q, %v; want hello first", body, err)
	}

	second := oldCA.Client("second", "second")
	files.install(t, second.CertFile, "tls.crt")
	files.install(t, second.KeyFile, "tls.key")
	if body, err := getFresh(t, hc, oldURL); err != nil || body != "hello second" {
		t.Errorf("GET after the client certificate was rotated = %q, %v; want hello second", body, err)
	}
	third := oldCA.Client("third", "third")
	files.install(t, third.CertFile, "tls.crt")
	if body, err := getFresh(t, hc, oldURL); err != nil || body != "hello second" {
		t.Errorf("GET with only the new certificate written, not its key = %q, %v; want hello second (the last good pair)", body, err)
	}
	if !strings.Contains(logs.String(), "tls certificate not reloaded") {
		t.Errorf("no warning logged for a client certificate that does not match its key; log:\n%s", logs)
	}

	// The client trusts the new CA's server once its bundle says so.
	if body, err := getFresh(t, hc, newURL); err == nil {
		t.Fatalf("GET of the new CA's server before the client trusts it = %q; want refused", body)
	}
	files.install(t, newCA.CAFile, "client-ca.pem")
	// The new CA's server accepts the new CA's client certificates once
	// its client CA bundle says so (the client's certificate is the new
	// CA's from here on).
	fourth := newCA.Client("fourth", "fourth")
	files.install(t, fourth.CertFile, "tls.crt")
	files.install(t, fourth.KeyFile, "tls.key")
	if body, err := getFresh(t, hc, newURL); err == nil {
		t.Fatalf("GET with the new CA's client certificate before the server trusts it = %q; want refused", body)
	}
	files.install(t, newCA.CAFile, "server-client-ca.pem")
	if body, err := getFresh(t, hc, newURL); err != nil || body != "hello fourth" {
		t.Errorf("GET after both CA bundles were rotated = %q, %v; want hello fourth", body, err)
	}
	// CA bundles replaced by something that is not one keep the last,
	// the client's and the server's.
	for _, name := range []string{"client-ca.pem", "server-client-ca.pem"} {
		files.install(t, keyFile, name)
		if body, err := getFresh(t, hc, newURL); err != nil || body != "hello fourth" {
			t.Errorf("GET after %s was overwritten with garbage = %q, %v; want hello fourth (the last good bundle)", name, body, err)
		}
		if want := filepath.Join(files.dir, name); !strings.Contains(logs.String(), "tls CA bundle not reloaded") || !strings.Contains(logs.String(), want) {
			t.Errorf("no warning logged for %s, which does not load; log:\n%s", want, logs)
		}
	}
}

// TestHTTPClientFlagErrors: wrong client flags fail at startup, naming the
// flag.
func TestHTTPClientFlagErrors(t *testing.T) {
	pki := ledgertest.NewPKI(t)
	pair, other := pki.Client("api", "api"), pki.Client("other", "other")
	missing := filepath.Join(t.TempDir(), "missing.pem")
	for _, tc := range []struct {
		name string
		f    httpClientFlags
		want string
	}{
		{"cert without key", httpClientFlags{certFile: pair.CertFile}, "--http-client-cert needs --http-client-key"},
		{"key without cert", httpClientFlags{keyFile: pair.KeyFile}, "--http-client-key needs --http-client-cert"},
		{"missing cert", httpClientFlags{certFile: missing, keyFile: pair.KeyFile}, "--http-client-cert: stat " + missing},
		{"key of another certificate", httpClientFlags{certFile: pair.CertFile, keyFile: other.KeyFile}, "private key does not match"},
		{"missing CA", httpClientFlags{caFile: missing}, "--http-client-ca: stat " + missing},
		{"CA not PEM", httpClientFlags{caFile: pair.KeyFile}, "--http-client-ca " + pair.KeyFile + " holds no PEM certificate"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if _, err := tc.f.transport(slog.New(slog.DiscardHandler), 0); err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("transport(%+v) = %v; want an error containing %q", tc.f, err, tc.want)
			}
		})
	}
}

// TestAPIProxyPresentsClientCertificate: the api's proxy to a role whose
// server requires client certificates (the approval queue, the operators'
// APIs) goes through with --http-client-*, and answers 502
// upstream_unavailable without them.
func TestAPIProxyPresentsClientCertificate(t *testing.T) {
	pki := ledgertest.NewPKI(t)
	server, client := pki.Server("approvals"), pki.Client("api", "ledger-api")
	upstream := "https://" + startHTTP(t, httpTLSFlags{certFile: server.CertFile, keyFile: server.KeyFile, clientCAFile: pki.CAFile}, nil, hello)
	logger := slog.New(slog.DiscardHandler)
	for _, tc := range []struct {
		name       string
		f          httpClientFlags
		wantStatus int
		wantBody   string
	}{
		{"with the client flags", httpClientFlags{certFile: client.CertFile, keyFile: client.KeyFile, caFile: pki.CAFile}, http.StatusOK, "hello ledger-api"},
		{"without a client certificate", httpClientFlags{caFile: pki.CAFile}, http.StatusBadGateway, "upstream_unavailable"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			tr, err := tc.f.transport(logger, 0)
			if err != nil {
				t.Fatal(err)
			}
			proxy, err := newProxy(upstream, tr, logger)
			if err != nil {
				t.Fatal(err)
			}
			rec := httptest.NewRecorder()
			proxy.ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/v1/approvals", nil))
			if rec.Code != tc.wantStatus || !strings.Contains(rec.Body.String(), tc.wantBody) {
				t.Errorf("proxied GET = %d %q; want %d with %q", rec.Code, rec.Body, tc.wantStatus, tc.wantBody)
			}
		})
	}
}

// TestCLIPresentsClientCertificate: the CLI's --api requests (here `ledger
// approvals list`) use the client flags, given as LEDGER_HTTP_CLIENT_*
// variables.
func TestCLIPresentsClientCertificate(t *testing.T) {
	pki := ledgertest.NewPKI(t)
	server, client := pki.Server("api"), pki.Client("operator", "u_ops")
	// Answers the list with the client certificate it was shown.
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		json.NewEncoder(w).Encode(map[string]any{"approvals": []any{}, "client": r.TLS.PeerCertificates[0].Subject.CommonName})
	})
	api := "https://" + startHTTP(t, httpTLSFlags{certFile: server.CertFile, keyFile: server.KeyFile, clientCAFile: pki.CAFile}, nil, h)
	t.Setenv("LEDGER_HTTP_CLIENT_CERT", client.CertFile)
	t.Setenv("LEDGER_HTTP_CLIENT_KEY", client.KeyFile)
	t.Setenv("LEDGER_HTTP_CLIENT_CA", pki.CAFile)

	root := newRoot()
	var out bytes.Buffer
	root.SetOut(&out)
	root.SetErr(io.Discard)
	root.SetArgs([]string{"approvals", "list", "--json", "--api", api, "--assertion", "not-checked-here"})
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := root.ExecuteContext(ctx); err != nil {
		t.Fatalf("ledger approvals list: %v", err)
	}
	if !strings.Contains(out.String(), `"client": "u_ops"`) {
		t.Errorf("ledger approvals list printed %q; want the server to have seen the client certificate u_ops", out.String())
	}
}

// TestDemoBackendFetchesKeysOverMutualTLS: a verifier fetches
// --credential-jwks-url with the client flags, so an executor's key set
// can be served only to clients with a certificate; without them, a
// credential cannot be checked and the call is refused without an effect.
func TestDemoBackendFetchesKeysOverMutualTLS(t *testing.T) {
	pki := ledgertest.NewPKI(t)
	server, client := pki.Server("executor-0"), pki.Client("backend", "demo-backend")
	broker, err := credentials.New(credentials.Config{})
	if err != nil {
		t.Fatal(err)
	}
	jwks := "https://" + startHTTP(t, httpTLSFlags{certFile: server.CertFile, keyFile: server.KeyFile, clientCAFile: pki.CAFile}, nil, broker.Handler()) + credentials.JWKSPath
	cred, err := broker.Mint(credentials.Grant{Tenant: "t_a", User: "u", Agent: "a", Executor: "e", Tool: "create_ticket", ToolVersion: 1,
		Audience: demobackend.DefaultAudience, CallID: "call_k-1", IdempotencyKey: "k-1"})
	if err != nil {
		t.Fatal(err)
	}
	// The introspection endpoint (the reconciler's, in a deployment)
	// also requires client certificates; this one says every credential
	// is active, and who asked.
	var asked atomic.Value
	introspect := "https://" + startHTTP(t, httpTLSFlags{certFile: server.CertFile, keyFile: server.KeyFile, clientCAFile: pki.CAFile}, nil,
		http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			asked.Store(r.TLS.PeerCertificates[0].Subject.CommonName)
			w.Header().Set("Content-Type", "application/json")
			io.WriteString(w, `{"active":true}`)
		})) + "/v1/introspect"
	for _, tc := range []struct {
		name       string
		flags      []string
		wantStatus int
	}{
		{"with the client flags", []string{"--http-client-cert", client.CertFile, "--http-client-key", client.KeyFile, "--http-client-ca", pki.CAFile}, 0},
		{"with the CA only", []string{"--http-client-ca", pki.CAFile}, http.StatusServiceUnavailable},
	} {
		t.Run(tc.name, func(t *testing.T) {
			addr := freeAddr(t)
			startDemoBackend(t, addr, append([]string{"--credential-jwks-url", jwks, "--introspect-url", introspect}, tc.flags...)...)
			_, err := httptool.New(httptool.Config{}).Call(t.Context(), httptool.Request{
				URL: "http://" + addr + "/tools/create_ticket", IdempotencyKey: "k-1", TenantID: "t_a",
				CallID: "call_k-1", Attempt: 1, Arguments: []byte(`{"title":"printer on fire"}`), Credential: cred.Token,
			})
			var te *httptool.Error
			switch {
			case tc.wantStatus == 0 && err != nil:
				t.Errorf("call with a credential whose keys are fetched over mutual TLS: %v; want accepted", err)
			case tc.wantStatus == 0 && asked.Load() != "demo-backend":
				t.Errorf("introspection asked by %v; want the backend's client certificate, demo-backend", asked.Load())
			case tc.wantStatus != 0 && (!errors.As(err, &te) || te.Status != tc.wantStatus):
				t.Errorf("call: %v; want status %d", err, tc.wantStatus)
			}
		})
	}
}
