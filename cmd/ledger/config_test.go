package main

import (
	"strings"
	"testing"
)

// A DSN shown in a log or a banner shows none of its secrets, wherever
// the DSN puts them, and still says where it points.
func TestRedactDSN(t *testing.T) {
	for _, tc := range []struct{ dsn, want string }{
		{"postgresql://ledger:s3cret@crdb:26257/ledger?sslmode=verify-full", "crdb:26257"},
		{"postgresql://ledger@crdb:26257/ledger?sslmode=verify-full&sslkey=/k.pem&sslpassword=s3cret", "sslmode=verify-full"},
		{"postgres://ledger@db/ledger?password=s3cret", "db/ledger"},
		{"clickhouse://ch:9000/ledger?username=ledger&password=s3cret", "username=ledger"},
		{"clickhouse://ch:9000/ledger?Password=s3cret&access_token=s3cret", "ch:9000"},
		{"host=crdb user=ledger password=s3cret", "(dsn)"},
		{"crdb:26257?password=s3cret", "(dsn)"},
	} {
		got := redactDSN(tc.dsn)
		if strings.Contains(got, "s3cret") {
			t.Errorf("redactDSN(%q) = %q: shows the secret", tc.dsn, got)
		}
		if !strings.Contains(got, tc.want) {
			t.Errorf("redactDSN(%q) = %q; want it to show %q", tc.dsn, got, tc.want)
		}
	}
}
