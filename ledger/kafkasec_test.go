package ledger_test

import (
	"bytes"
	"context"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/toolcall-ledger/ledger/ledger"
	"github.com/toolcall-ledger/ledger/ledger/ledgertest"
)

// These tests need kfake itself (SASL users, ACLs, a TLS listener, control
// of the SASL exchange), so they start their own cluster whatever
// LEDGER_TEST_KAFKA_BROKERS says.

var secTopics = ledger.Topics{}.WithDefaults()

// secCluster starts a one-broker cluster with the requests and events
// topics, closed when t ends.
func secCluster(t *testing.T, opts ...kfake.Opt) *kfake.Cluster {
	t.Helper()
	c, err := kfake.NewCluster(append([]kfake.Opt{
		kfake.NumBrokers(1),
		kfake.SeedTopics(2, secTopics.Requests, secTopics.Events),
		kfake.GroupMinSessionTimeout(500 * time.Millisecond),
	}, opts...)...)
	if err != nil {
		t.Fatalf("kfake: %v", err)
	}
	t.Cleanup(c.Close)
	return c
}

// serverTLS is a listener config with a server certificate from p.
func serverTLS(p *ledgertest.PKI) *tls.Config {
	return &tls.Config{Certificates: []tls.Certificate{p.Server("broker").Cert}, MinVersion: tls.VersionTLS12}
}

func secret(t *testing.T) string {
	t.Helper()
	b := make([]byte, 12)
	_, _ = rand.Read(b)
	return "s3cret-" + hex.EncodeToString(b)
}

// roundTrip produces a fresh record to topic and consumes it back, with
// one client of cc, within 15s.
func roundTrip(t *testing.T, cc ledger.ClientConfig, topic string) error {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), 15*time.Second)
	defer cancel()
	cl, err := ledger.NewClient(cc, kgo.ConsumeTopics(topic), kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()))
	if err != nil {
		return err
	}
	defer cl.Close()
	want := []byte(secret(t))
	if err := cl.ProduceSync(ctx, &kgo.Record{Topic: topic, Value: want}).FirstErr(); err != nil {
		return fmt.Errorf("produce: %w", err)
	}
	for {
		fetches := cl.PollFetches(ctx)
		if err := ctx.Err(); err != nil {
			return fmt.Errorf("consume: %w", err)
		}
		var ferr error
		fetches.EachError(func(_ string, _ int32, err error) { ferr = err })
		if ferr != nil {
			return fmt.Errorf("consume: %w", ferr)
		}
		for _, r := range fetches.Records() {
			if bytes.Equal(r.Value, want) {
				return nil
			}
		}
	}
}

// ping asks the cluster for metadata once, with a short deadline: the
// error of a refused connection or authentication, without retries.
func ping(t *testing.T, cc ledger.ClientConfig) error {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), 3*time.Second)
	defer cancel()
	cl, err := ledger.NewClient(cc)
	if err != nil {
		return err
	}
	defer cl.Close()
	return cl.Ping(ctx)
}

// refused checks that ping failed on the connection itself, not merely by
// running out of time.
func refused(t *testing.T, cc ledger.ClientConfig, secrets ...string) error {
	t.Helper()
	err := ping(t, cc)
	if err == nil {
		t.Fatalf("ping with %v succeeded; want it refused", cc.Security)
	}
	if errors.Is(err, context.DeadlineExceeded) {
		t.Errorf("ping with %v: %v; want a refusal, not a timeout", cc.Security, err)
	}
	for _, s := range secrets {
		if s != "" && strings.Contains(err.Error(), s) {
			t.Errorf("error %q contains a secret", err)
		}
	}
	return err
}

// firstReadEOF checks err is franz-go's guess for a broker that hung up
// at once: TLS or SASL expected but missing.
func firstReadEOF(t *testing.T, err error) {
	t.Helper()
	if _, ok := errors.AsType[*kgo.ErrFirstReadEOF](err); !ok {
		t.Errorf("got %v (%T); want a *kgo.ErrFirstReadEOF", err, err)
	}
}

// tlsAlert checks err is the server refusing the TLS handshake.
func tlsAlert(t *testing.T, err error) {
	t.Helper()
	if op, ok := errors.AsType[*net.OpError](err); !ok || op.Op != "remote error" {
		t.Errorf("got %v (%T); want the broker's TLS alert", err, err)
	}
}

// authFailed checks err is a failed authentication: kfake hangs up
// (io.EOF) where Kafka answers SASL_AUTHENTICATION_FAILED.
func authFailed(t *testing.T, err error) {
	t.Helper()
	if !errors.Is(err, io.EOF) && !errors.Is(err, kerr.SaslAuthenticationFailed) {
		t.Errorf("got %v (%T); want the broker to refuse the authentication", err, err)
	}
}

func TestKafkaTLS(t *testing.T) {
	p := ledgertest.NewPKI(t)
	c := secCluster(t, kfake.TLS(serverTLS(p)))
	cc := ledger.ClientConfig{Brokers: c.ListenAddrs()}

	t.Run("trusted CA", func(t *testing.T) {
		cc := cc
		cc.Security.TLS.CAFile = p.CAFile // implies Enabled
		if err := roundTrip(t, cc, secTopics.Requests); err != nil {
			t.Fatalf("round trip over TLS: %v", err)
		}
	})
	t.Run("server name", func(t *testing.T) {
		// The certificate names 127.0.0.1 and localhost: "localhost"
		// passes whatever host is dialled, another name does not.
		cc := cc
		cc.Security.TLS = ledger.TLS{CAFile: p.CAFile, ServerName: "localhost"}
		if err := ping(t, cc); err != nil {
			t.Errorf("ping with server name localhost: %v", err)
		}
		cc.Security.TLS.ServerName = "broker.example"
		err := refused(t, cc)
		var hostErr x509.HostnameError
		if !errors.As(err, &hostErr) {
			t.Errorf("ping with server name broker.example: %v (%T); want a hostname mismatch", err, err)
		}
	})
	t.Run("plaintext client", func(t *testing.T) {
		firstReadEOF(t, refused(t, cc))
	})
	t.Run("other CA", func(t *testing.T) {
		cc := cc
		cc.Security.TLS = ledger.TLS{Enabled: true, CAFile: ledgertest.NewPKI(t).CAFile}
		err := refused(t, cc)
		var unknown x509.UnknownAuthorityError
		if !errors.As(err, &unknown) {
			t.Errorf("ping trusting another CA: %v (%T); want an unknown authority error", err, err)
		}
	})
	t.Run("insecure skip verify", func(t *testing.T) {
		cc := cc
		cc.Security.TLS = ledger.TLS{InsecureSkipVerify: true}
		if err := ping(t, cc); err != nil {
			t.Errorf("ping skipping verification: %v", err)
		}
	})
}

func TestKafkaMutualTLS(t *testing.T) {
	p := ledgertest.NewPKI(t)
	stls := serverTLS(p)
	stls.ClientAuth = tls.RequireAndVerifyClientCert
	stls.ClientCAs = p.Pool
	c := secCluster(t, kfake.TLS(stls))
	cc := ledger.ClientConfig{Brokers: c.ListenAddrs()}

	t.Run("with client certificate", func(t *testing.T) {
		pair := p.Client("ledger", "ledger")
		cc := cc
		cc.Security.TLS = ledger.TLS{CAFile: p.CAFile, CertFile: pair.CertFile, KeyFile: pair.KeyFile}
		if err := roundTrip(t, cc, secTopics.Events); err != nil {
			t.Fatalf("round trip with a client certificate: %v", err)
		}
	})
	t.Run("without client certificate", func(t *testing.T) {
		cc := cc
		cc.Security.TLS = ledger.TLS{CAFile: p.CAFile}
		tlsAlert(t, refused(t, cc))
	})
	t.Run("certificate of another CA", func(t *testing.T) {
		pair := ledgertest.NewPKI(t).Client("stranger", "stranger")
		cc := cc
		cc.Security.TLS = ledger.TLS{CAFile: p.CAFile, CertFile: pair.CertFile, KeyFile: pair.KeyFile}
		tlsAlert(t, refused(t, cc))
	})
}

func TestKafkaSASL(t *testing.T) {
	pass := secret(t)
	wrong := secret(t)
	c := secCluster(t,
		kfake.EnableSASL(),
		kfake.Superuser("PLAIN", "plain-user", pass),
		kfake.Superuser("SCRAM-SHA-256", "scram256-user", pass),
		kfake.Superuser("SCRAM-SHA-512", "scram512-user", pass),
	)
	for _, tc := range []struct {
		name      string
		mechanism string
		user      string
	}{
		{"PLAIN", "PLAIN", "plain-user"},
		{"SCRAM-SHA-256 lower case", "scram-sha-256", "scram256-user"},
		{"SCRAM-SHA-512", "SCRAM-SHA-512", "scram512-user"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cc := ledger.ClientConfig{Brokers: c.ListenAddrs()}
			cc.Security.SASL = ledger.SASL{Mechanism: tc.mechanism, User: tc.user, Password: pass}
			if err := roundTrip(t, cc, secTopics.Requests); err != nil {
				t.Fatalf("round trip as %s: %v", tc.user, err)
			}
			cc.Security.SASL.Password = wrong
			authFailed(t, refused(t, cc, wrong, pass))
		})
	}
	t.Run("no SASL", func(t *testing.T) {
		firstReadEOF(t, refused(t, ledger.ClientConfig{Brokers: c.ListenAddrs()}))
	})
	t.Run("mechanism the user lacks", func(t *testing.T) {
		cc := ledger.ClientConfig{Brokers: c.ListenAddrs()}
		cc.Security.SASL = ledger.SASL{Mechanism: "SCRAM-SHA-512", User: "scram256-user", Password: pass}
		authFailed(t, refused(t, cc, pass))
	})
}

func TestKafkaTLSAndSCRAM(t *testing.T) {
	p := ledgertest.NewPKI(t)
	pass := secret(t)
	c := secCluster(t,
		kfake.TLS(serverTLS(p)),
		kfake.EnableSASL(),
		kfake.Superuser("SCRAM-SHA-512", "ledger", pass),
	)
	cc := ledger.ClientConfig{Brokers: c.ListenAddrs(), Security: ledger.Security{
		TLS:  ledger.TLS{Enabled: true, CAFile: p.CAFile},
		SASL: ledger.SASL{Mechanism: "SCRAM-SHA-512", User: "ledger", Password: pass},
	}}
	if err := roundTrip(t, cc, secTopics.Events); err != nil {
		t.Fatalf("round trip over TLS with SCRAM: %v", err)
	}
	noTLS := cc
	noTLS.Security.TLS = ledger.TLS{}
	firstReadEOF(t, refused(t, noTLS, pass))
	noSASL := cc
	noSASL.Security.SASL = ledger.SASL{}
	firstReadEOF(t, refused(t, noSASL))
	wrong := cc
	wrong.Security.SASL.Password = secret(t)
	authFailed(t, refused(t, wrong, wrong.Security.SASL.Password, pass))
}

// allow is an ALLOW ACL for a literal resource.
func allow(rt kmsg.ACLResourceType, name string, op kmsg.ACLOperation) kfake.ACL {
	return kfake.ACL{Resource: rt, Name: name, Pattern: kmsg.ACLResourcePatternTypeLiteral, Operation: op, Allow: true}
}

func TestKafkaACLTopics(t *testing.T) {
	pass := secret(t)
	c := secCluster(t,
		kfake.EnableSASL(),
		kfake.EnableACLs(),
		kfake.User("SCRAM-SHA-256", "agent", pass,
			allow(kmsg.ACLResourceTypeTopic, secTopics.Requests, kmsg.ACLOperationWrite)),
	)
	cc := ledger.ClientConfig{Brokers: c.ListenAddrs()}
	cc.Security.SASL = ledger.SASL{Mechanism: "SCRAM-SHA-256", User: "agent", Password: pass}
	cl, err := ledger.NewClient(cc)
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
	defer cancel()

	if err := cl.ProduceSync(ctx, &kgo.Record{Topic: secTopics.Requests, Value: []byte("ok")}).FirstErr(); err != nil {
		t.Errorf("produce to %s, which agent may write: %v", secTopics.Requests, err)
	}
	err = cl.ProduceSync(ctx, &kgo.Record{Topic: secTopics.Events, Value: []byte("forged")}).FirstErr()
	if !errors.Is(err, kerr.TopicAuthorizationFailed) {
		t.Errorf("produce to %s, which agent may not write: %v; want %v", secTopics.Events, err, kerr.TopicAuthorizationFailed)
	}
}

// EnsureTopics under a principal that may describe the topics but not
// create them succeeds once they exist (an admin created them), and asks
// to create only a missing one, which that principal is refused. Before,
// it asked to create every topic, and brokers check Create before
// whether a topic exists.
func TestEnsureTopicsWithoutCreate(t *testing.T) {
	pass := secret(t)
	describe := []kfake.ACL{}
	for _, tp := range []string{secTopics.Requests, secTopics.Events, secTopics.Control, secTopics.DLQ} {
		describe = append(describe, allow(kmsg.ACLResourceTypeTopic, tp, kmsg.ACLOperationDescribe))
	}
	c := secCluster(t,
		kfake.EnableSASL(),
		kfake.EnableACLs(),
		kfake.User("SCRAM-SHA-256", "admin", pass, allow(kmsg.ACLResourceTypeCluster, "kafka-cluster", kmsg.ACLOperationCreate)),
		kfake.User("SCRAM-SHA-256", "role", pass, describe...),
	)
	client := func(user string) *kgo.Client {
		cc := ledger.ClientConfig{Brokers: c.ListenAddrs()}
		cc.Security.SASL = ledger.SASL{Mechanism: "SCRAM-SHA-256", User: user, Password: pass}
		cl, err := ledger.NewClient(cc)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(cl.Close)
		return cl
	}
	ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
	defer cancel()
	cfg := ledger.TopicConfig{Topics: secTopics, Partitions: 2}
	if err := ledger.EnsureTopics(ctx, client("role"), cfg); !errors.Is(err, kerr.TopicAuthorizationFailed) || !strings.Contains(err.Error(), secTopics.Control) {
		t.Errorf("EnsureTopics without Create, the control topic missing: %v; want %s refused, TopicAuthorizationFailed", err, secTopics.Control)
	}
	if err := ledger.EnsureTopics(ctx, client("admin"), cfg); err != nil {
		t.Fatalf("EnsureTopics as the admin: %v", err)
	}
	if err := ledger.EnsureTopics(ctx, client("role"), cfg); err != nil {
		t.Errorf("EnsureTopics without Create, every topic there: %v; want nothing to do", err)
	}
}

// logCapture keeps the error attributes a Loop logs.
type logCapture struct {
	mu   sync.Mutex
	errs []error
}

func (h *logCapture) Enabled(context.Context, slog.Level) bool { return true }
func (h *logCapture) WithAttrs([]slog.Attr) slog.Handler       { return h }
func (h *logCapture) WithGroup(string) slog.Handler            { return h }
func (h *logCapture) Handle(_ context.Context, r slog.Record) error {
	r.Attrs(func(a slog.Attr) bool {
		if err, ok := a.Value.Any().(error); ok {
			h.mu.Lock()
			h.errs = append(h.errs, err)
			h.mu.Unlock()
		}
		return true
	})
	return nil
}

func (h *logCapture) anyIs(target error) bool {
	h.mu.Lock()
	defer h.mu.Unlock()
	for _, err := range h.errs {
		if errors.Is(err, target) {
			return true
		}
	}
	return false
}

// The ledger's transactional path (Loop) works for a user granted what a
// processor needs, and is refused for one lacking TransactionalId Write.
func TestKafkaACLTransactionalLoop(t *testing.T) {
	const group, txn = "copy", "copy-1"
	pass := secret(t)
	processorACLs := []kfake.ACL{
		allow(kmsg.ACLResourceTypeTopic, secTopics.Requests, kmsg.ACLOperationRead),
		allow(kmsg.ACLResourceTypeTopic, secTopics.Events, kmsg.ACLOperationWrite),
		allow(kmsg.ACLResourceTypeGroup, group, kmsg.ACLOperationRead),
	}
	c := secCluster(t,
		kfake.EnableSASL(),
		kfake.EnableACLs(),
		kfake.Superuser("SCRAM-SHA-512", "admin", pass),
		kfake.User("SCRAM-SHA-512", "processor", pass,
			append(processorACLs, allow(kmsg.ACLResourceTypeTransactionalId, txn, kmsg.ACLOperationWrite))...),
		kfake.User("SCRAM-SHA-512", "no-txn", pass, processorACLs...),
	)
	as := func(user string) ledger.ClientConfig {
		cc := ledger.ClientConfig{Brokers: c.ListenAddrs()}
		cc.Security.SASL = ledger.SASL{Mechanism: "SCRAM-SHA-512", User: user, Password: pass}
		return cc
	}
	admin, err := ledger.NewClient(as("admin"))
	if err != nil {
		t.Fatal(err)
	}
	defer admin.Close()
	if err := admin.ProduceSync(t.Context(), &kgo.Record{Topic: secTopics.Requests, Key: []byte("k"), Value: []byte("v")}).FirstErr(); err != nil {
		t.Fatalf("seed a request: %v", err)
	}

	// run runs a copying loop as user until cond holds, then stops it.
	run := func(t *testing.T, user string, logs *logCapture, cond func() error) {
		t.Helper()
		loop, err := ledger.NewLoop(ledger.LoopConfig{
			Client: as(user), Group: group, Topics: []string{secTopics.Requests},
			TransactionalID: txn, Tick: 50 * time.Millisecond, Logger: slog.New(logs),
		}, func(_ context.Context, recs []*kgo.Record) (ledger.Output, error) {
			var out ledger.Output
			for _, r := range recs {
				out.Records = append(out.Records, &kgo.Record{Topic: secTopics.Events, Key: r.Key, Value: r.Value})
			}
			return out, nil
		})
		if err != nil {
			t.Fatal(err)
		}
		ctx, cancel := context.WithCancel(t.Context())
		done := make(chan error, 1)
		go func() { done <- loop.Run(ctx) }()
		defer func() {
			cancel()
			if err := <-done; err != nil {
				t.Errorf("loop.Run: %v", err)
			}
		}()
		ledgertest.WaitFor(t, 15*time.Second, cond)
	}
	eventsHeld := func() int {
		cl, err := ledger.NewClient(as("admin"), kgo.ConsumeTopics(secTopics.Events), kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()))
		if err != nil {
			t.Fatal(err)
		}
		defer cl.Close()
		ctx, cancel := context.WithTimeout(t.Context(), time.Second)
		defer cancel()
		n := 0
		for ctx.Err() == nil {
			n += len(cl.PollFetches(ctx).Records())
		}
		return n
	}

	t.Run("without TransactionalId Write", func(t *testing.T) {
		logs := &logCapture{}
		run(t, "no-txn", logs, func() error {
			if !logs.anyIs(kerr.TransactionalIDAuthorizationFailed) {
				return errors.New("loop has not reported TransactionalIDAuthorizationFailed yet")
			}
			return nil
		})
		if n := eventsHeld(); n != 0 {
			t.Errorf("%s holds %d records after the refused loop; want 0", secTopics.Events, n)
		}
	})
	t.Run("with TransactionalId Write", func(t *testing.T) {
		logs := &logCapture{}
		run(t, "processor", logs, func() error {
			if n := eventsHeld(); n != 1 {
				return fmt.Errorf("%s holds %d records; want 1", secTopics.Events, n)
			}
			return nil
		})
		if logs.anyIs(kerr.TransactionalIDAuthorizationFailed) || logs.anyIs(kerr.GroupAuthorizationFailed) || logs.anyIs(kerr.TopicAuthorizationFailed) {
			t.Errorf("the granted loop logged authorization errors: %v", logs.errs)
		}
	})
}

// saslTap answers the SASL exchange in place of kfake, which has no
// OAUTHBEARER, and keeps every SASLAuthenticate payload.
type saslTap struct {
	mu       sync.Mutex
	payloads [][]byte
}

func (s *saslTap) install(c *kfake.Cluster) {
	c.ControlKey(int16(kmsg.SASLHandshake), func(req kmsg.Request) (kmsg.Response, error, bool) {
		c.KeepControl()
		hs := req.(*kmsg.SASLHandshakeRequest)
		resp := hs.ResponseKind().(*kmsg.SASLHandshakeResponse)
		resp.SupportedMechanisms = []string{ledger.MechanismOAuthBearer}
		if hs.Mechanism != ledger.MechanismOAuthBearer {
			resp.ErrorCode = kerr.UnsupportedSaslMechanism.Code
		}
		return resp, nil, true
	})
	c.ControlKey(int16(kmsg.SASLAuthenticate), func(req kmsg.Request) (kmsg.Response, error, bool) {
		c.KeepControl()
		auth := req.(*kmsg.SASLAuthenticateRequest)
		s.mu.Lock()
		s.payloads = append(s.payloads, bytes.Clone(auth.SASLAuthBytes))
		s.mu.Unlock()
		// An empty server response is RFC 7628's success.
		return auth.ResponseKind(), nil, true
	})
}

func (s *saslTap) seen() [][]byte {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([][]byte(nil), s.payloads...)
}

// The client side of OAUTHBEARER: the initial response is RFC 7628's
// "n,,^Aauth=Bearer <token>^A^A", the token is the token file's content
// trimmed, and the file is read again for each authentication, so a
// rotated token reaches the next connection of the same client.
func TestKafkaOAuthBearer(t *testing.T) {
	c := secCluster(t)
	tap := &saslTap{}
	tap.install(c)
	tokenFile := filepath.Join(t.TempDir(), "token")
	write := func(s string) {
		if err := os.WriteFile(tokenFile, []byte(s), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	first, second := "eyJ0b2tlbi1vbmUifQ.first", "eyJ0b2tlbi10d28ifQ.second"
	write("  " + first + "\n")

	cc := ledger.ClientConfig{Brokers: c.ListenAddrs()}
	cc.Security.SASL = ledger.SASL{Mechanism: "oauthbearer", TokenFile: tokenFile}
	cl, err := ledger.NewClient(cc)
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	if err := cl.Ping(t.Context()); err != nil {
		t.Fatalf("ping: %v", err)
	}
	before := len(tap.seen())
	if before == 0 {
		t.Fatal("the client connected without authenticating")
	}

	write(second + "\n")
	// A produce opens the client's produce connection to the broker,
	// which authenticates anew.
	if err := cl.ProduceSync(t.Context(), &kgo.Record{Topic: secTopics.Requests, Value: []byte("v")}).FirstErr(); err != nil {
		t.Fatalf("produce: %v", err)
	}
	seen := tap.seen()
	if len(seen) == before {
		t.Fatal("no authentication after the token was rotated")
	}
	want := func(tok string) string { return "n,,\x01auth=Bearer " + tok + "\x01\x01" }
	for i, p := range seen[:before] {
		if string(p) != want(first) {
			t.Errorf("authentication %d, before the rotation, sent %q; want %q", i, p, want(first))
		}
	}
	// The produce connection authenticated last, after the rotation.
	if last := seen[len(seen)-1]; string(last) != want(second) {
		t.Errorf("authentication after the rotation sent %q; want %q", last, want(second))
	}

	t.Run("unreadable token file", func(t *testing.T) {
		cc := cc
		cc.Security.SASL.TokenFile = filepath.Join(t.TempDir(), "missing")
		err := refused(t, cc)
		var se *ledger.SecurityError
		if !errors.As(err, &se) || se.Field != "SASL.TokenFile" || !errors.Is(err, fs.ErrNotExist) {
			t.Errorf("ping with a missing token file: %v; want a *SecurityError on SASL.TokenFile wrapping fs.ErrNotExist", err)
		}
	})
	t.Run("empty token file", func(t *testing.T) {
		write("\n")
		err := refused(t, cc, first, second)
		var se *ledger.SecurityError
		if !errors.As(err, &se) || se.Field != "SASL.TokenFile" {
			t.Errorf("ping with an empty token file: %v; want a *SecurityError on SASL.TokenFile", err)
		}
	})
}

func TestSecurityConfigErrors(t *testing.T) {
	pass := secret(t)
	p := ledgertest.NewPKI(t)
	pair, other := p.Client("a", "a"), p.Client("b", "b")
	dir := t.TempDir()
	notPEM := filepath.Join(dir, "not.pem")
	if err := os.WriteFile(notPEM, []byte("not a certificate "+pass), 0o600); err != nil {
		t.Fatal(err)
	}
	missing := filepath.Join(dir, "missing.pem")
	for _, tc := range []struct {
		name     string
		sec      ledger.Security
		field    string
		contains []string
		is       error
	}{
		{
			name:     "unknown mechanism",
			sec:      ledger.Security{SASL: ledger.SASL{Mechanism: "GSSAPI", User: "u", Password: pass}},
			field:    "SASL.Mechanism",
			contains: []string{"GSSAPI", "PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512", "OAUTHBEARER"},
		},
		{
			name:  "missing password",
			sec:   ledger.Security{SASL: ledger.SASL{Mechanism: "SCRAM-SHA-256", User: "u"}},
			field: "SASL.Password", contains: []string{"SCRAM-SHA-256"},
		},
		{
			name:  "missing user",
			sec:   ledger.Security{SASL: ledger.SASL{Mechanism: "plain", Password: pass}},
			field: "SASL.User", contains: []string{"PLAIN"},
		},
		{
			name:  "credentials without mechanism",
			sec:   ledger.Security{SASL: ledger.SASL{User: "u", Password: pass}},
			field: "SASL.Mechanism",
		},
		{
			name:  "oauthbearer without token file",
			sec:   ledger.Security{SASL: ledger.SASL{Mechanism: "OAUTHBEARER"}},
			field: "SASL.TokenFile",
		},
		{
			name:  "oauthbearer with a password",
			sec:   ledger.Security{SASL: ledger.SASL{Mechanism: "OAUTHBEARER", TokenFile: notPEM, User: "u", Password: pass}},
			field: "SASL.Password",
		},
		{
			name:  "oauthbearer with a user",
			sec:   ledger.Security{SASL: ledger.SASL{Mechanism: "OAUTHBEARER", TokenFile: notPEM, User: "u"}},
			field: "SASL.User",
		},
		{
			name:  "token file with SCRAM",
			sec:   ledger.Security{SASL: ledger.SASL{Mechanism: "SCRAM-SHA-512", User: "u", Password: pass, TokenFile: notPEM}},
			field: "SASL.TokenFile",
		},
		{
			name:  "missing CA file",
			sec:   ledger.Security{TLS: ledger.TLS{CAFile: missing}},
			field: "TLS.CAFile", contains: []string{missing}, is: fs.ErrNotExist,
		},
		{
			name:  "CA file without a certificate",
			sec:   ledger.Security{TLS: ledger.TLS{CAFile: notPEM}},
			field: "TLS.CAFile", contains: []string{notPEM},
		},
		{
			name:  "certificate without key",
			sec:   ledger.Security{TLS: ledger.TLS{CertFile: pair.CertFile}},
			field: "TLS.KeyFile",
		},
		{
			name:  "key without certificate",
			sec:   ledger.Security{TLS: ledger.TLS{KeyFile: pair.KeyFile}},
			field: "TLS.CertFile",
		},
		{
			name:  "missing certificate file",
			sec:   ledger.Security{TLS: ledger.TLS{CertFile: missing, KeyFile: pair.KeyFile}},
			field: "TLS.CertFile", is: fs.ErrNotExist,
		},
		{
			name:  "missing key file",
			sec:   ledger.Security{TLS: ledger.TLS{CertFile: pair.CertFile, KeyFile: missing}},
			field: "TLS.KeyFile", is: fs.ErrNotExist,
		},
		{
			name:  "key of another certificate",
			sec:   ledger.Security{TLS: ledger.TLS{CertFile: pair.CertFile, KeyFile: other.KeyFile}},
			field: "TLS.CertFile",
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			// Through NewClient, as every client of the product is built.
			_, err := ledger.NewClient(ledger.ClientConfig{Brokers: []string{"127.0.0.1:1"}, Security: tc.sec})
			var se *ledger.SecurityError
			if !errors.As(err, &se) {
				t.Fatalf("NewClient(%v) = %v; want a *ledger.SecurityError", tc.sec, err)
			}
			if se.Field != tc.field {
				t.Errorf("NewClient(%v): field %q; want %q (%v)", tc.sec, se.Field, tc.field, err)
			}
			for _, s := range tc.contains {
				if !strings.Contains(err.Error(), s) {
					t.Errorf("NewClient(%v) = %q; want it to name %q", tc.sec, err, s)
				}
			}
			if tc.is != nil && !errors.Is(err, tc.is) {
				t.Errorf("NewClient(%v) = %v; want it to wrap %v", tc.sec, err, tc.is)
			}
			if strings.Contains(err.Error(), pass) {
				t.Errorf("NewClient(%v) = %q: contains the password", tc.sec, err)
			}
			if strings.Contains(err.Error(), "BEGIN") {
				t.Errorf("NewClient(%v) = %q: quotes a PEM file", tc.sec, err)
			}
		})
	}

	t.Run("valid", func(t *testing.T) {
		for _, sec := range []ledger.Security{
			{},
			{TLS: ledger.TLS{Enabled: true}},
			{TLS: ledger.TLS{CAFile: p.CAFile, CertFile: pair.CertFile, KeyFile: pair.KeyFile}},
			{SASL: ledger.SASL{Mechanism: "Scram-Sha-512", User: "u", Password: pass}},
			{SASL: ledger.SASL{Mechanism: "OAUTHBEARER", TokenFile: missing}}, // read at connection time
		} {
			if _, err := sec.Opts(); err != nil {
				t.Errorf("%v.Opts() = %v; want nil", sec, err)
			}
		}
	})
}

// Printing or logging a configuration never shows the password.
func TestSecurityStringHidesSecrets(t *testing.T) {
	pass := secret(t)
	cc := ledger.ClientConfig{Brokers: []string{"b:9092"}, Security: ledger.Security{
		TLS:  ledger.TLS{CAFile: "/etc/kafka/ca.pem"},
		SASL: ledger.SASL{Mechanism: "scram-sha-256", User: "ledger", Password: pass},
	}}
	var logged bytes.Buffer
	slog.New(slog.NewJSONHandler(&logged, nil)).Info("kafka", "security", cc.Security, "sasl", cc.Security.SASL, "client", cc)
	outputs := map[string]string{
		"%v":       fmt.Sprintf("%v", cc),
		"%+v":      fmt.Sprintf("%+v", cc),
		"%#v":      fmt.Sprintf("%#v", cc),
		"%s":       fmt.Sprintf("%s", cc.Security),
		"sasl %+v": fmt.Sprintf("%+v", cc.Security.SASL),
		"sasl %#v": fmt.Sprintf("%#v", cc.Security.SASL),
		"slog":     logged.String(),
	}
	for how, out := range outputs {
		if strings.Contains(out, pass) {
			t.Errorf("%s shows the password: %s", how, out)
		}
	}
	if s := cc.Security.String(); !strings.Contains(s, "SCRAM-SHA-256") || !strings.Contains(s, "user=ledger") || !strings.Contains(s, "tls=on") {
		t.Errorf("Security.String() = %q; want the mechanism, the user and TLS on", s)
	}
	var rec struct {
		Security map[string]any `json:"security"`
	}
	if err := json.Unmarshal(logged.Bytes(), &rec); err != nil {
		t.Fatalf("decode log %s: %v", logged.String(), err)
	}
	if rec.Security["sasl_mechanism"] != "SCRAM-SHA-256" || rec.Security["sasl_user"] != "ledger" || rec.Security["sasl_password"] != ledger.Redacted || rec.Security["tls"] != true {
		t.Errorf("logged security = %v; want mechanism, user, a redacted password and tls", rec.Security)
	}
}

// elsewhereListener listens on loopback but names itself at a TEST-NET
// address, which kfake then advertises in its metadata: a cluster whose
// seed is on loopback and whose brokers are not.
type elsewhereListener struct{ net.Listener }

func (l elsewhereListener) Addr() net.Addr {
	return &net.TCPAddr{IP: net.ParseIP("192.0.2.1"), Port: l.Listener.Addr().(*net.TCPAddr).Port}
}

// PLAIN and OAUTHBEARER send the password or the token as they are: over
// plaintext, only to loopback brokers unless AllowPlaintext says the
// network is trusted. SCRAM, or TLS, sends nothing an eavesdropper can
// use.
func TestSASLSecretsStayOffPlaintext(t *testing.T) {
	pass := secret(t)
	var seed string
	c := secCluster(t,
		kfake.EnableSASL(),
		kfake.Superuser("PLAIN", "plain-user", pass),
		kfake.ListenFn(func(network, addr string) (net.Listener, error) {
			ln, err := net.Listen(network, addr)
			if err != nil {
				return nil, err
			}
			seed = ln.Addr().String()
			return elsewhereListener{ln}, nil
		}),
	)
	advertised := c.ListenAddrs()[0]
	if !strings.HasPrefix(advertised, "192.0.2.1:") {
		t.Fatalf("kfake advertises %s; want the TEST-NET address", advertised)
	}
	plain := ledger.SASL{Mechanism: "plain", User: "plain-user", Password: pass}
	tokenFile := filepath.Join(t.TempDir(), "token")
	if err := os.WriteFile(tokenFile, []byte(pass), 0o600); err != nil {
		t.Fatal(err)
	}
	bearer := ledger.SASL{Mechanism: "OAUTHBEARER", TokenFile: tokenFile}

	t.Run("seed broker elsewhere", func(t *testing.T) {
		for _, sasl := range []ledger.SASL{plain, bearer} {
			_, err := ledger.NewClient(ledger.ClientConfig{Brokers: []string{seed, advertised}, Security: ledger.Security{SASL: sasl}})
			se, ok := errors.AsType[*ledger.SecurityError](err)
			if !ok || se.Field != "SASL.Mechanism" || !strings.Contains(err.Error(), advertised) || !strings.Contains(err.Error(), "--kafka-sasl-allow-plaintext") {
				t.Errorf("NewClient with %v and a seed at %s = %v; want a *SecurityError on SASL.Mechanism naming the broker and the flag", sasl, advertised, err)
			}
			if err != nil && strings.Contains(err.Error(), pass) {
				t.Errorf("error %q contains the secret", err)
			}
		}
	})
	t.Run("seed address forms", func(t *testing.T) {
		for addr, loopback := range map[string]bool{
			"127.0.0.1:9092": true, "127.8.9.10:9092": true, "localhost:9092": true, "LOCALHOST:9092": true,
			"[::1]:9092": true, "[::1]": true, "::1": true, "localhost": true,
			"10.0.0.5:9092": false, "kafka.internal:9092": false, "[2001:db8::1]:9092": false,
			"localhost.example.com:9092": false, "127.0.0.1.example.com:9092": false, "": false,
		} {
			cl, err := ledger.NewClient(ledger.ClientConfig{Brokers: []string{addr}, Security: ledger.Security{SASL: plain}})
			if cl != nil {
				cl.Close()
			}
			_, refused := errors.AsType[*ledger.SecurityError](err)
			if loopback && err != nil || !loopback && !refused {
				t.Errorf("a PLAIN seed at %q over plaintext: NewClient = %v; want it refused: %v", addr, err, !loopback)
			}
		}
	})
	t.Run("allowed", func(t *testing.T) {
		for _, sec := range []ledger.Security{
			{SASL: ledger.SASL{Mechanism: "SCRAM-SHA-256", User: "u", Password: pass}},
			{TLS: ledger.TLS{Enabled: true}, SASL: plain},
			{SASL: ledger.SASL{Mechanism: "PLAIN", User: "u", Password: pass, AllowPlaintext: true}},
			{SASL: ledger.SASL{Mechanism: "OAUTHBEARER", TokenFile: tokenFile, AllowPlaintext: true}},
		} {
			cl, err := ledger.NewClient(ledger.ClientConfig{Brokers: []string{advertised}, Security: sec})
			if err != nil {
				t.Errorf("NewClient with %v and a seed at %s = %v; want nil", sec, advertised, err)
				continue
			}
			cl.Close()
		}
	})
	// The seed answers on loopback; the broker its metadata names is
	// elsewhere and is not dialled.
	brokerZero := func(t *testing.T, sasl ledger.SASL) error {
		t.Helper()
		cl, err := ledger.NewClient(ledger.ClientConfig{Brokers: []string{seed}, Security: ledger.Security{SASL: sasl}})
		if err != nil {
			t.Fatalf("NewClient with a loopback seed: %v", err)
		}
		defer cl.Close()
		ctx, cancel := context.WithTimeout(t.Context(), 5*time.Second)
		defer cancel()
		if _, err := kmsg.NewPtrMetadataRequest().RequestWith(ctx, cl); err != nil {
			t.Fatalf("metadata through the loopback seed: %v", err)
		}
		ctx, cancel = context.WithTimeout(t.Context(), time.Second)
		defer cancel()
		_, err = cl.Broker(0).Request(ctx, kmsg.NewPtrApiVersionsRequest())
		if err == nil {
			t.Fatalf("a request to broker 0 at %s succeeded; want it to fail", advertised)
		}
		return err
	}
	t.Run("advertised broker elsewhere", func(t *testing.T) {
		err := brokerZero(t, plain)
		if se, ok := errors.AsType[*ledger.SecurityError](err); !ok || !strings.Contains(se.Error(), advertised) {
			t.Errorf("a request to broker 0 at %s with PLAIN over plaintext: %v (%T); want a *SecurityError naming it", advertised, err, err)
		}
		if strings.Contains(err.Error(), pass) {
			t.Errorf("error %q contains the password", err)
		}
	})
	t.Run("advertised broker elsewhere, allowed", func(t *testing.T) {
		allowed := plain
		allowed.AllowPlaintext = true
		// Dialled: TEST-NET does not answer, so the request fails, but
		// not for the guard.
		if err := brokerZero(t, allowed); err != nil {
			if _, ok := errors.AsType[*ledger.SecurityError](err); ok {
				t.Errorf("a request to broker 0 with AllowPlaintext: %v; want it dialled, not refused", err)
			}
		}
	})
}

// secretVolume is a directory laid out as the kubelet lays out a mounted
// Secret: each file a symlink through ..data to a directory of the
// current version, which an update replaces with one rename.
type secretVolume struct {
	t       *testing.T
	dir     string
	version int
}

func newSecretVolume(t *testing.T, files map[string][]byte) *secretVolume {
	t.Helper()
	v := &secretVolume{t: t, dir: t.TempDir()}
	v.update(files)
	for name := range files {
		if err := os.Symlink(filepath.Join("..data", name), v.path(name)); err != nil {
			t.Fatal(err)
		}
	}
	return v
}

// path is the file name as a pod sees it.
func (v *secretVolume) path(name string) string { return filepath.Join(v.dir, name) }

// update writes files as a new version and swaps ..data to it, removing
// the previous version, as the kubelet does when the Secret changes.
func (v *secretVolume) update(files map[string][]byte) {
	v.t.Helper()
	v.version++
	data := fmt.Sprintf("..v%d", v.version)
	if err := os.Mkdir(filepath.Join(v.dir, data), 0o700); err != nil {
		v.t.Fatal(err)
	}
	for name, b := range files {
		if err := os.WriteFile(filepath.Join(v.dir, data, name), b, 0o600); err != nil {
			v.t.Fatal(err)
		}
	}
	tmp := filepath.Join(v.dir, "..data_tmp")
	if err := os.Symlink(data, tmp); err != nil {
		v.t.Fatal(err)
	}
	if err := os.Rename(tmp, filepath.Join(v.dir, "..data")); err != nil {
		v.t.Fatal(err)
	}
	if v.version > 1 {
		if err := os.RemoveAll(filepath.Join(v.dir, fmt.Sprintf("..v%d", v.version-1))); err != nil {
			v.t.Fatal(err)
		}
	}
}

// connTracker counts a client's open broker connections.
type connTracker struct {
	mu   sync.Mutex
	open map[net.Conn]bool
}

func (c *connTracker) OnBrokerConnect(_ kgo.BrokerMetadata, _ time.Duration, conn net.Conn, err error) {
	if err != nil || conn == nil {
		return
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.open == nil {
		c.open = make(map[net.Conn]bool)
	}
	c.open[conn] = true
}

func (c *connTracker) OnBrokerDisconnect(_ kgo.BrokerMetadata, conn net.Conn) {
	c.mu.Lock()
	defer c.mu.Unlock()
	delete(c.open, conn)
}

// waitIdle waits until the client has closed every connection (its idle
// timeout), so that its next request dials again.
func (c *connTracker) waitIdle(t *testing.T) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		c.mu.Lock()
		n := len(c.open)
		c.mu.Unlock()
		if n == 0 {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d connection(s) still open after 10s; want them closed as idle", n)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// produceOnce produces one record to the requests topic within 10s.
func produceOnce(t *testing.T, cl *kgo.Client, step string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
	defer cancel()
	if err := cl.ProduceSync(ctx, &kgo.Record{Topic: secTopics.Requests, Value: []byte(step)}).FirstErr(); err != nil {
		t.Fatalf("%s: produce: %v", step, err)
	}
}

// A long-lived client presents its renewed certificate on its next
// connection, without a restart: the broker refusing the old one after
// the renewal (as it would once it expired) does not stop it. A renewal
// caught half-written leaves the last good pair in use.
func TestKafkaTLSClientCertificateRotation(t *testing.T) {
	p := ledgertest.NewPKI(t)
	a, b := p.Client("a", "ledger-a"), p.Client("b", "ledger-b")
	var (
		revokedA atomic.Bool
		mu       sync.Mutex
		lastCN   string
	)
	stls := serverTLS(p)
	stls.ClientAuth = tls.RequireAndVerifyClientCert
	stls.ClientCAs = p.Pool
	stls.VerifyPeerCertificate = func(_ [][]byte, chains [][]*x509.Certificate) error {
		cn := chains[0][0].Subject.CommonName
		if cn == "ledger-a" && revokedA.Load() {
			return errors.New("certificate ledger-a no longer accepted")
		}
		mu.Lock()
		defer mu.Unlock()
		lastCN = cn
		return nil
	}
	presented := func(t *testing.T, step, want string) {
		t.Helper()
		mu.Lock()
		defer mu.Unlock()
		if lastCN != want {
			t.Errorf("%s: the broker last saw certificate %q; want %q", step, lastCN, want)
		}
	}
	c := secCluster(t, kfake.TLS(stls))

	vol := newSecretVolume(t, map[string][]byte{
		"tls.crt": ledgertest.ReadFile(t, a.CertFile), "tls.key": ledgertest.ReadFile(t, a.KeyFile), "ca.crt": ledgertest.ReadFile(t, p.CAFile),
	})
	var logs ledgertest.LogBuffer
	cc := ledger.ClientConfig{
		Brokers: c.ListenAddrs(),
		Logger:  slog.New(slog.NewJSONHandler(&logs, nil)),
		Security: ledger.Security{TLS: ledger.TLS{
			CAFile: vol.path("ca.crt"), CertFile: vol.path("tls.crt"), KeyFile: vol.path("tls.key"),
		}},
	}
	conns := &connTracker{}
	cl, err := ledger.NewClient(cc, kgo.ConnIdleTimeout(time.Second), kgo.WithHooks(conns))
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()

	produceOnce(t, cl, "with certificate A")
	presented(t, "with certificate A", "ledger-a")

	// Half-written: B's certificate beside A's key, written in place.
	if err := os.WriteFile(vol.path("tls.crt"), ledgertest.ReadFile(t, b.CertFile), 0o600); err != nil {
		t.Fatal(err)
	}
	conns.waitIdle(t)
	produceOnce(t, cl, "half-written renewal")
	presented(t, "half-written renewal", "ledger-a")
	if got := logs.String(); !strings.Contains(got, "not reloaded") {
		t.Errorf("logs after a half-written renewal:\n%s\nwant a warning that the certificate was not reloaded", got)
	}

	// The renewal lands (the Secret updated in place), and the broker
	// refuses A from now on.
	vol.update(map[string][]byte{
		"tls.crt": ledgertest.ReadFile(t, b.CertFile), "tls.key": ledgertest.ReadFile(t, b.KeyFile), "ca.crt": ledgertest.ReadFile(t, p.CAFile),
	})
	revokedA.Store(true)
	conns.waitIdle(t)
	produceOnce(t, cl, "after the renewal")
	presented(t, "after the renewal", "ledger-b")

	got := logs.String()
	for _, secret := range []string{"BEGIN", "PRIVATE KEY", string(ledgertest.ReadFile(t, a.KeyFile)[40:80]), string(ledgertest.ReadFile(t, b.KeyFile)[40:80])} {
		if strings.Contains(got, secret) {
			t.Errorf("logs quote key material (%q):\n%s", secret, got)
		}
	}
}

// A long-lived client trusts the brokers' new CA once the CA file is
// rotated, and then no longer the old one; the brokers' certificates are
// still checked against the CA and the server name, as crypto/tls checks
// them; a CA file that does not parse leaves the last good CAs in use.
func TestKafkaTLSCARotation(t *testing.T) {
	before, after := ledgertest.NewPKI(t), ledgertest.NewPKI(t)
	oldCert, newCert := before.Server("broker").Cert, after.Server("broker").Cert
	otherName := after.Server("elsewhere", "broker.example").Cert
	var serving atomic.Pointer[tls.Certificate]
	serving.Store(&oldCert)
	c := secCluster(t, kfake.TLS(&tls.Config{
		MinVersion:     tls.VersionTLS12,
		GetCertificate: func(*tls.ClientHelloInfo) (*tls.Certificate, error) { return serving.Load(), nil },
	}))

	vol := newSecretVolume(t, map[string][]byte{"ca.crt": ledgertest.ReadFile(t, before.CAFile)})
	cc := ledger.ClientConfig{Brokers: c.ListenAddrs(), Security: ledger.Security{TLS: ledger.TLS{CAFile: vol.path("ca.crt")}}}
	conns := &connTracker{}
	cl, err := ledger.NewClient(cc, kgo.ConnIdleTimeout(time.Second), kgo.WithHooks(conns))
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	produceOnce(t, cl, "before the rotation")

	// The brokers move to the new CA's certificates; the CA file follows.
	serving.Store(&newCert)
	vol.update(map[string][]byte{"ca.crt": ledgertest.ReadFile(t, after.CAFile)})
	conns.waitIdle(t)
	produceOnce(t, cl, "after the rotation")

	vol.update(map[string][]byte{"ca.crt": []byte("not a certificate")})
	conns.waitIdle(t)
	produceOnce(t, cl, "with a CA file that does not parse")

	ping := func() error {
		ctx, cancel := context.WithTimeout(t.Context(), 3*time.Second)
		defer cancel()
		return cl.Ping(ctx)
	}
	conns.waitIdle(t)
	serving.Store(&oldCert)
	err = ping()
	var unknown x509.UnknownAuthorityError
	if !errors.As(err, &unknown) {
		t.Errorf("ping a broker of the old CA after the rotation: %v (%T); want an unknown authority error", err, err)
	}
	serving.Store(&otherName)
	err = ping()
	var hostErr x509.HostnameError
	if !errors.As(err, &hostErr) {
		t.Errorf("ping a broker whose certificate names broker.example: %v (%T); want a hostname mismatch", err, err)
	}
}
