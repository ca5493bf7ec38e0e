package pgstore

import (
	"crypto/tls"
	"crypto/x509"
	"errors"
	"net/url"
	"os"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/toolcall-ledger/ledger/ledger/ledgertest"
)

// withParams returns dsn with the query parameters set.
func withParams(t *testing.T, dsn string, params map[string]string) string {
	t.Helper()
	u, err := url.Parse(dsn)
	if err != nil || u.Scheme == "" {
		t.Fatalf("LEDGER_TEST_PG_DSN is not a URL; the TLS tests set sslmode in its query")
	}
	q := u.Query()
	for k, v := range params {
		q.Set(k, v)
	}
	u.RawQuery = q.Encode()
	return u.String()
}

// requireServerTLS fails t, saying how to fix it, when the server under
// test does not serve TLS at all; the TLS tests' own failures are then
// about the store, not about the test server's setup.
func requireServerTLS(t *testing.T, dsn string) {
	t.Helper()
	conn, err := pgx.Connect(t.Context(), dsn)
	if err != nil {
		t.Fatalf("connect to the server under test: %v", err)
	}
	defer conn.Close(t.Context())
	var crdb bool
	if err := conn.QueryRow(t.Context(), "SELECT version() LIKE '%CockroachDB%'").Scan(&crdb); err != nil {
		t.Fatal(err)
	}
	if crdb {
		// A CockroachDB that answers is secure (TLS) unless it was
		// started --insecure, which the sslmode=require test reports.
		return
	}
	var ssl string
	if err := conn.QueryRow(t.Context(), "SHOW ssl").Scan(&ssl); err != nil {
		t.Fatal(err)
	}
	if ssl != "on" {
		t.Fatalf("the PostgreSQL under test has ssl = %s: `bash deploy/testservices.sh start` turns it on for its private server; for another server, turn ssl on there", ssl)
	}
}

// checkEncrypted asserts that the store's connections are TLS, as the
// client sees them and, on PostgreSQL, as the server does.
func checkEncrypted(t *testing.T, s *Store) {
	t.Helper()
	c, err := s.pool.Acquire(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Release()
	tc, ok := c.Conn().PgConn().Conn().(*tls.Conn)
	if !ok {
		t.Fatalf("the store's connection is a %T; want a *tls.Conn", c.Conn().PgConn().Conn())
	}
	if v := tc.ConnectionState().Version; v < tls.VersionTLS12 {
		t.Errorf("the store's connection negotiated %s; want TLS 1.2 or later", tls.VersionName(v))
	}
	if s.CockroachDB() {
		return // no pg_stat_ssl there
	}
	var ssl bool
	if err := c.QueryRow(t.Context(), "SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()").Scan(&ssl); err != nil {
		t.Fatal(err)
	}
	if !ssl {
		t.Errorf("pg_stat_ssl says the store's connection is not encrypted")
	}
}

// TestTLSRequire: with sslmode=require in its DSN the store talks to
// the database over TLS only.
func TestTLSRequire(t *testing.T) {
	dsn := testDSN(t)
	requireServerTLS(t, dsn)
	s := open(t, Config{DSN: withParams(t, dsn, map[string]string{"sslmode": "require"}), Schema: newSchema(t, dsn)})
	defer s.Close()
	checkEncrypted(t, s)
}

// TestTLSVerifyFull: with sslmode=verify-full the store checks the
// server's certificate against sslrootcert: the server's own CA is
// accepted, another CA refused with an error that says so (and keeps the
// DSN's password to itself).
func TestTLSVerifyFull(t *testing.T) {
	dsn := testDSN(t)
	requireServerTLS(t, dsn)

	t.Run("another CA", func(t *testing.T) {
		const canary = "canary-pw-4e1d0b"
		wrong := withParams(t, dsn, map[string]string{"sslmode": "verify-full", "sslrootcert": ledgertest.NewPKI(t).CAFile})
		u, _ := url.Parse(wrong)
		u.User = url.UserPassword(u.User.Username(), canary)
		s, err := Open(t.Context(), Config{DSN: u.String(), Schema: newSchema(t, dsn)})
		if err == nil {
			s.Close()
			t.Fatal("Open(verify-full with another CA's sslrootcert) = nil error; want the server's certificate refused")
		}
		var unknown x509.UnknownAuthorityError
		if !errors.As(err, &unknown) {
			t.Errorf("Open(verify-full with another CA) = %v; want an x509.UnknownAuthorityError in its chain", err)
		}
		if !strings.Contains(err.Error(), "certificate") {
			t.Errorf("Open(verify-full with another CA) = %q; want it to say the certificate is the problem", err)
		}
		if strings.Contains(err.Error(), canary) {
			t.Errorf("Open error %q leaks the DSN's password", err)
		}
	})

	t.Run("the server's CA", func(t *testing.T) {
		ca := os.Getenv("LEDGER_TEST_PG_TLS_CA")
		if ca == "" {
			const why = "LEDGER_TEST_PG_TLS_CA (the CA of the server's certificate; deploy/testservices.sh sets it for its private server) is not set"
			if os.Getenv("LEDGER_TEST_REQUIRE") == "1" {
				t.Fatal(why + " and LEDGER_TEST_REQUIRE=1")
			}
			t.Skip("SKIPPING: " + why)
		}
		s := open(t, Config{DSN: withParams(t, dsn, map[string]string{"sslmode": "verify-full", "sslrootcert": ca}), Schema: newSchema(t, dsn)})
		defer s.Close()
		checkEncrypted(t, s)
	})
}

// A DSN naming a TLS file that cannot be read says which file, not that
// the DSN does not parse (pgx reads the files as it parses), and still
// never repeats the DSN's password; one that does not parse says only
// that. No server is needed: both fail before connecting.
func TestDSNErrorsNameUnreadableFilesOnly(t *testing.T) {
	const canary = "canary-pw-91be"
	for _, tc := range []struct {
		dsn, want string
	}{
		{"postgresql://ledger:" + canary + "@db:26257/ledger?sslmode=verify-full&sslrootcert=/nonexistent/ca.pem", "/nonexistent/ca.pem"},
		{"postgresql://ledger:" + canary + "@db:26257/ledger?sslmode=verify-full&sslcert=/nonexistent/c.pem&sslkey=/nonexistent/k.pem", "/nonexistent/"},
		{"postgresql://ledger:" + canary + "@db:notaport/ledger", "cannot parse DSN"},
	} {
		_, err := Open(t.Context(), Config{DSN: tc.dsn})
		if err == nil || !strings.Contains(err.Error(), tc.want) || strings.Contains(err.Error(), canary) {
			t.Errorf("Open(%s) = %v; want an error naming %q, without the password", strings.ReplaceAll(tc.dsn, canary, "…"), err, tc.want)
		}
		if _, err := Connect(t.Context(), tc.dsn); err == nil || !strings.Contains(err.Error(), tc.want) || strings.Contains(err.Error(), canary) {
			t.Errorf("Connect(%s) = %v; want an error naming %q, without the password", strings.ReplaceAll(tc.dsn, canary, "…"), err, tc.want)
		}
	}
}
