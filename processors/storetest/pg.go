package storetest

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"os"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
)

// PGDSN returns the PostgreSQL or CockroachDB server under test, from
// LEDGER_TEST_PG_DSN (deploy/testservices.sh starts one). Without it the
// test fails when LEDGER_TEST_REQUIRE=1 (as under make test), and is
// skipped loudly otherwise.
func PGDSN(t testing.TB) string {
	t.Helper()
	dsn := os.Getenv("LEDGER_TEST_PG_DSN")
	if dsn != "" {
		return dsn
	}
	const how = `start one with: eval "$(bash deploy/testservices.sh start)"`
	if os.Getenv("LEDGER_TEST_REQUIRE") == "1" {
		t.Fatal("LEDGER_TEST_PG_DSN is not set and LEDGER_TEST_REQUIRE=1: the execution store cannot be tested without PostgreSQL or CockroachDB; " + how)
	}
	t.Skip("SKIPPING: LEDGER_TEST_PG_DSN is not set; " + how)
	return ""
}

// FreshSchema names a schema for one test (pgstore.Config.Schema creates
// it) and drops it, with everything in it, when the test ends.
func FreshSchema(t testing.TB, dsn string) string {
	t.Helper()
	b := make([]byte, 6)
	_, _ = rand.Read(b)
	schema := "ledger_test_" + hex.EncodeToString(b)
	t.Cleanup(func() { DropSchema(t, dsn, schema) })
	return schema
}

// DropSchema drops schema and everything in it.
func DropSchema(t testing.TB, dsn, schema string) {
	t.Helper()
	// t.Context is already done during cleanup.
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	conn, err := pgx.Connect(ctx, dsn)
	if err != nil {
		t.Errorf("drop schema %s: %v", schema, err)
		return
	}
	defer conn.Close(ctx)
	if _, err := conn.Exec(ctx, "DROP SCHEMA IF EXISTS "+pgx.Identifier{schema}.Sanitize()+" CASCADE"); err != nil {
		t.Errorf("drop schema %s: %v", schema, err)
	}
}
