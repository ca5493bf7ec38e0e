package main

import (
	"context"
	"crypto/tls"
	"errors"
	"log/slog"
	"net"
	"net/http"
	"time"

	"github.com/spf13/pflag"

	"github.com/toolcall-ledger/ledger/ledger/tlsfiles"
)

// httpClientFlags say what the ledger's own HTTP clients present and trust
// when they call the ledger's servers: the api's proxies to the approval
// queue and the operators' APIs, the credential verifiers' key set fetches
// (--credential-jwks-url), the demo backend's introspection, the CLI's
// --api requests and `ledger bench --attach`'s reads of --ledger-ops. With them those servers can require client certificates
// (--http-tls-client-ca) and be served by a private CA without
// SSL_CERT_FILE. Root flags, as --http-tls-*: one role, one identity.
type httpClientFlags struct {
	certFile string
	keyFile  string
	caFile   string
}

func (f *httpClientFlags) register(fs *pflag.FlagSet) {
	fs.StringVar(&f.certFile, "http-client-cert", "", "PEM certificate (with its chain) the ledger's HTTP clients present to servers that ask for one (the api's proxies, --credential-jwks-url fetches, introspection, the CLI's --api, ledger bench's --ledger-ops): for servers run with --http-tls-client-ca; read again when the file changes; needs --http-client-key")
	fs.StringVar(&f.keyFile, "http-client-key", "", "PEM private key of --http-client-cert")
	fs.StringVar(&f.caFile, "http-client-ca", "", "PEM CA certificates the ledger's HTTP clients trust for https servers, instead of the system's roots (and SSL_CERT_FILE); read again when the file changes")
}

// transport returns the round tripper of the ledger's HTTP clients:
// http.DefaultTransport's settings (proxy from the environment, timeouts),
// with the flags' client certificate and CAs. It loads every file now, so a
// wrong flag fails the command at startup. maxIdlePerHost, when positive,
// sizes the pool of idle connections per host.
func (f *httpClientFlags) transport(logger *slog.Logger, maxIdlePerHost int) (*http.Transport, error) {
	t := http.DefaultTransport.(*http.Transport).Clone()
	if maxIdlePerHost > 0 {
		t.MaxIdleConns, t.MaxIdleConnsPerHost = max(t.MaxIdleConns, maxIdlePerHost), maxIdlePerHost
	}
	switch {
	case f.certFile != "" && f.keyFile == "":
		return nil, errors.New("--http-client-cert needs --http-client-key")
	case f.keyFile != "" && f.certFile == "":
		return nil, errors.New("--http-client-key needs --http-client-cert")
	case f.certFile == "" && f.caFile == "":
		return t, nil
	}
	// The files are looked at by every connection (tlsfiles.Config's
	// default), so that a rotation is used from the next one.
	reload := tlsfiles.Config{Logger: logger}
	var kp *tlsfiles.Pair
	if f.certFile != "" {
		var err error
		kp, err = tlsfiles.LoadPair(tlsfiles.File{Path: f.certFile, Name: "--http-client-cert"}, tlsfiles.File{Path: f.keyFile, Name: "--http-client-key"}, reload)
		if err != nil {
			return nil, err
		}
	}
	var cas *tlsfiles.Pool
	if f.caFile != "" {
		var err error
		cas, err = tlsfiles.LoadPool(tlsfiles.File{Path: f.caFile, Name: "--http-client-ca"}, reload)
		if err != nil {
			return nil, err
		}
	}
	// tlsConfig is a connection's: the client certificate and the CAs of
	// the moment, and crypto/tls's own check of the server against them.
	tlsConfig := func(serverName string) *tls.Config {
		cfg := &tls.Config{MinVersion: tls.VersionTLS12, ServerName: serverName, NextProtos: []string{"h2", "http/1.1"}}
		if kp != nil {
			cfg.GetClientCertificate = kp.GetClientCertificate
		}
		if cas != nil {
			cfg.RootCAs = cas.CertPool()
		}
		return cfg
	}
	// Direct connections get a config made as they are dialled, so that
	// a certificate or CA bundle rotated on disk is used from the next
	// connection. Through a proxy (HTTPS_PROXY), net/http uses
	// TLSClientConfig: the CAs read at start.
	dialer := &net.Dialer{Timeout: 30 * time.Second, KeepAlive: 30 * time.Second}
	t.DialTLSContext = func(ctx context.Context, network, addr string) (net.Conn, error) {
		host, _, err := net.SplitHostPort(addr)
		if err != nil {
			return nil, err
		}
		raw, err := dialer.DialContext(ctx, network, addr)
		if err != nil {
			return nil, err
		}
		conn := tls.Client(raw, tlsConfig(host))
		if t.TLSHandshakeTimeout > 0 {
			var cancel context.CancelFunc
			ctx, cancel = context.WithTimeout(ctx, t.TLSHandshakeTimeout)
			defer cancel()
		}
		if err := conn.HandshakeContext(ctx); err != nil {
			raw.Close()
			return nil, err
		}
		return conn, nil
	}
	t.TLSClientConfig = tlsConfig("")
	return t, nil
}

// client is an *http.Client on f's transport with timeout.
func (f *httpClientFlags) client(logger *slog.Logger, timeout time.Duration) (*http.Client, error) {
	t, err := f.transport(logger, 0)
	if err != nil {
		return nil, err
	}
	return &http.Client{Timeout: timeout, Transport: t}, nil
}
