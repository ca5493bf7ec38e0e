// Package chtest gives tests a ClickHouse server and a database of their
// own, for the chstore projection and the packages that test against it.
//
// The server under test is named by one of, in this order:
//
//   - LEDGER_TEST_CLICKHOUSE_DSN, a full DSN as clickhouse.ParseDSN reads
//     it (to point the tests at a current ClickHouse, with a user and
//     password);
//   - LEDGER_TEST_CLICKHOUSE_ADDR, host:port of the native protocol, user
//     default without a password (deploy/testservices.sh starts one).
//
// With neither, a test fails when LEDGER_TEST_REQUIRE=1 (as under make
// test and CI), and is skipped loudly otherwise.
package chtest

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"os"
	"testing"
	"time"

	"github.com/ClickHouse/clickhouse-go/v2"
)

// DSN returns the ClickHouse server under test (see the package doc).
func DSN(t testing.TB) string {
	t.Helper()
	if dsn := os.Getenv("LEDGER_TEST_CLICKHOUSE_DSN"); dsn != "" {
		return dsn
	}
	if addr := os.Getenv("LEDGER_TEST_CLICKHOUSE_ADDR"); addr != "" {
		return "clickhouse://default@" + addr + "/default"
	}
	const how = `start one with: eval "$(bash deploy/testservices.sh start)"`
	if os.Getenv("LEDGER_TEST_REQUIRE") == "1" {
		t.Fatal("neither LEDGER_TEST_CLICKHOUSE_DSN nor LEDGER_TEST_CLICKHOUSE_ADDR is set and LEDGER_TEST_REQUIRE=1: the ClickHouse projection cannot be tested without ClickHouse; " + how)
	}
	t.Skip("SKIPPING: neither LEDGER_TEST_CLICKHOUSE_DSN nor LEDGER_TEST_CLICKHOUSE_ADDR is set; " + how)
	return ""
}

// FreshDatabase names a database for one test on the server of DSN (the
// store's Migrate creates it) and drops it, with every table in it, when
// the test ends.
func FreshDatabase(t testing.TB) string {
	t.Helper()
	dsn := DSN(t)
	b := make([]byte, 6)
	_, _ = rand.Read(b)
	db := "ledger_test_" + hex.EncodeToString(b)
	t.Cleanup(func() { DropDatabase(t, dsn, db) })
	return db
}

// DropDatabase drops db on the server of dsn.
func DropDatabase(t testing.TB, dsn, db string) {
	t.Helper()
	if err := exec(dsn, "DROP DATABASE IF EXISTS `"+db+"`"); err != nil {
		t.Errorf("drop database %s: %v", db, err)
	}
}

// Exec runs statement on the server of dsn, which it names every table
// of by its database, and fails t if it fails.
func Exec(t testing.TB, dsn, statement string) {
	t.Helper()
	if err := exec(dsn, statement); err != nil {
		t.Fatalf("%s: %v", statement, err)
	}
}

// Count runs query, a SELECT of one count, on the server of dsn, and
// returns the count; it fails t if the query fails.
func Count(t testing.TB, dsn, query string) uint64 {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
	defer cancel()
	opts, err := clickhouse.ParseDSN(dsn)
	if err == nil {
		opts.Auth.Database = ""
	}
	var n uint64
	if err == nil {
		var conn clickhouse.Conn
		if conn, err = clickhouse.Open(opts); err == nil {
			defer conn.Close()
			err = conn.QueryRow(ctx, query).Scan(&n)
		}
	}
	if err != nil {
		t.Fatalf("%s: %v", query, err)
	}
	return n
}

func exec(dsn, statement string) error {
	// t.Context is already done during cleanup.
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	opts, err := clickhouse.ParseDSN(dsn)
	if err != nil {
		return fmt.Errorf("parse DSN: %w", err)
	}
	opts.Auth.Database = ""
	conn, err := clickhouse.Open(opts)
	if err != nil {
		return err
	}
	defer conn.Close()
	return conn.Exec(ctx, statement)
}
