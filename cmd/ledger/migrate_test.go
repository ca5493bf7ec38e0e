package main

import (
	"bytes"
	"context"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/toolcall-ledger/ledger/ledger"
	"github.com/toolcall-ledger/ledger/processors"
	"github.com/toolcall-ledger/ledger/processors/pgstore"
)

// TestMigratePlainOutboxes: `ledger migrate --rewrite-plain-outboxes` leaves no
// compressed outbox behind, for a build that reads only plain ones, and
// the records read as they did.
func TestMigratePlainOutboxes(t *testing.T) {
	dsn := freshSchemaDSN(t)
	st, err := pgstore.Open(t.Context(), pgstore.Config{DSN: dsn})
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	outbox := []byte(`[{"v":1,"type":"requested","seq":1,"tenant_id":"t_a","idempotency_key":"k1","tool":"create_ticket","tool_version":1,"arguments_hash":"sha256:9e8d17a1f2273f665b7cbdfff2736da42b8d1f7c1feb3f0a3c9460c6817b138c"},` +
		`{"v":1,"type":"authorized","seq":2,"tenant_id":"t_a","idempotency_key":"k1","tool":"create_ticket","tool_version":1,"arguments_hash":"sha256:9e8d17a1f2273f665b7cbdfff2736da42b8d1f7c1feb3f0a3c9460c6817b138c"}]`)
	k := ledger.CallKey{TenantID: "t_a", IdempotencyKey: "k1"}
	if _, err := st.Admit(t.Context(), []processors.Admission{{Key: k, CallID: "c", ArgumentsHash: "h", Tool: "create_ticket", ToolVersion: 1, Status: processors.StatusAuthorized, Seq: 2, Outbox: outbox}}); err != nil {
		t.Fatal(err)
	}
	stored := func() []byte {
		t.Helper()
		conn, err := pgx.Connect(context.WithoutCancel(t.Context()), dsn)
		if err != nil {
			t.Fatal(err)
		}
		defer conn.Close(context.WithoutCancel(t.Context()))
		var b []byte
		if err := conn.QueryRow(t.Context(), "SELECT outbox FROM execution_records WHERE idempotency_key = 'k1'").Scan(&b); err != nil {
			t.Fatal(err)
		}
		return b
	}
	if b := stored(); bytes.Equal(b, outbox) {
		t.Fatal("the store wrote the outbox plain; want it compressed before the rewrite")
	}
	if out := cli(t, "migrate", "--crdb-dsn", dsn, "--rewrite-plain-outboxes"); !strings.Contains(out, "1 records scanned, 1 compressed outboxes rewritten as plain") {
		t.Errorf("ledger migrate --rewrite-plain-outboxes said:\n%s", out)
	}
	if b := stored(); !bytes.Equal(b, outbox) {
		t.Errorf("the table holds %q after the rewrite; want the plain outbox %q", b, outbox)
	}
	if r, err := st.Get(t.Context(), k); err != nil || !bytes.Equal(r.Outbox, outbox) {
		t.Errorf("Get after the rewrite = %q, %v; want the outbox as admitted", r.Outbox, err)
	}
}
