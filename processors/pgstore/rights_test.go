package pgstore

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"net/url"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/toolcall-ledger/ledger/ledger"
	"github.com/toolcall-ledger/ledger/processors"
)

// TestOpenWithoutDDLRights: once the schema is current (`ledger migrate`
// ran as a user that may run DDL), a role whose user may only read and
// write the tables opens the store and works: Open runs no DDL on a
// current schema. The old Open ran CREATE ... IF NOT EXISTS on every
// start, which such a user is refused.
func TestOpenWithoutDDLRights(t *testing.T) {
	dsn := testDSN(t)
	schema := newSchema(t, dsn)
	open(t, Config{DSN: dsn, Schema: schema}).Close()
	ctx := t.Context()

	b := make([]byte, 12)
	_, _ = rand.Read(b)
	role, password := "ledger_rw_"+hex.EncodeToString(b[:6]), hex.EncodeToString(b[6:])
	ident, sch := pgx.Identifier{role}.Sanitize(), pgx.Identifier{schema}.Sanitize()
	admin := func(ctx context.Context, stmts ...string) error {
		conn, err := Connect(ctx, dsn)
		if err != nil {
			return err
		}
		defer conn.Close(ctx)
		for _, stmt := range stmts {
			if _, err := conn.Exec(ctx, stmt); err != nil {
				return err
			}
		}
		return nil
	}
	if err := admin(ctx, "CREATE ROLE "+ident+" LOGIN PASSWORD '"+password+"'"); err != nil {
		t.Fatalf("create a role for the test (the test's user must be allowed to): %v", err)
	}
	t.Cleanup(func() {
		// Before the schema goes: a role that holds grants cannot be
		// dropped. t.Context is done during cleanup.
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		if err := admin(ctx, "REVOKE ALL ON ALL TABLES IN SCHEMA "+sch+" FROM "+ident,
			"REVOKE USAGE ON SCHEMA "+sch+" FROM "+ident, "DROP ROLE "+ident); err != nil {
			t.Errorf("drop the test's role %s: %v", role, err)
		}
	})
	if err := admin(ctx, "GRANT USAGE ON SCHEMA "+sch+" TO "+ident,
		"GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA "+sch+" TO "+ident); err != nil {
		t.Fatal(err)
	}
	u, err := url.Parse(dsn)
	if err != nil || u.Scheme == "" {
		t.Fatalf("LEDGER_TEST_PG_DSN must be a URL (postgres://...) for this test: %v", err)
	}
	u.User = url.UserPassword(role, password)

	s, err := Open(ctx, Config{DSN: u.String(), Schema: schema})
	if err != nil {
		t.Fatalf("Open as a user without DDL rights, on a current schema = %v; want it to open without DDL", err)
	}
	defer s.Close()
	// The premise: the user is refused DDL.
	if _, err := s.pool.Exec(ctx, "CREATE TABLE "+pgx.Identifier{schema, "ddl_probe"}.Sanitize()+" (a BIGINT)"); err == nil {
		t.Fatalf("user %s ran CREATE TABLE; want it refused, or the test proves nothing", role)
	}
	// And the store works through it: a call admitted and claimed.
	k := ledger.CallKey{TenantID: "t_acme", IdempotencyKey: "k"}
	admitAuthorized(t, s, k)
	res, err := s.Claim(ctx, []processors.Claim{{Key: k, ArgumentsHash: "h", Owner: "executor-1", Lease: time.Hour}})
	if err != nil || res[0].Outcome != processors.Claimed {
		t.Errorf("Claim as user %s = %+v, %v; want claimed", role, res, err)
	}
}
