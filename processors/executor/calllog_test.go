package executor

import (
	"bytes"
	"context"
	"log/slog"
	"strings"
	"testing"

	"github.com/toolcall-ledger/ledger/ledger"
	"github.com/toolcall-ledger/ledger/processors"
)

func TestCallLogNamesTheCallOnlyInRecordsKept(t *testing.T) {
	var buf bytes.Buffer
	l := slog.New(slog.NewTextHandler(&buf, &slog.HandlerOptions{Level: slog.LevelWarn}))
	rec := processors.Record{Key: ledger.CallKey{TenantID: "t1", IdempotencyKey: "k1"}, Tool: "create_ticket", Epoch: 3}
	log := callLog{ctx: context.Background(), l: l, rec: &rec, traceID: "tr1"}

	log.Info("dropped", "attempt", 1)
	if buf.Len() != 0 {
		t.Fatalf("a record below the level was written: %s", buf.String())
	}
	log.Warn("tool attempt failed", "attempt", 2)
	log.Error("mint credential", "err", "boom")
	lines := strings.Split(strings.TrimSpace(buf.String()), "\n")
	if len(lines) != 2 {
		t.Fatalf("got %d lines; want 2:\n%s", len(lines), buf.String())
	}
	for i, want := range []string{
		`level=WARN msg="tool attempt failed" call_key=t1/k1 trace_id=tr1 tool=create_ticket epoch=3 attempt=2`,
		`level=ERROR msg="mint credential" call_key=t1/k1 trace_id=tr1 tool=create_ticket epoch=3 err=boom`,
	} {
		if _, after, _ := strings.Cut(lines[i], " "); after != want {
			t.Errorf("line %d = %q; want %q after the time", i, after, want)
		}
	}
}
