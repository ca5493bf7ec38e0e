package chstore

import (
	"context"
	"testing"
	"time"

	"github.com/toolcall-ledger/ledger/ledger"
	"github.com/toolcall-ledger/ledger/projections"
	"github.com/toolcall-ledger/ledger/projections/projectionstest"
)

// BenchmarkWrite compares, in one run, Store.Write of a batch of
// generated events (every table's rows built and inserted) with a raw
// clickhouse-go batch insert of the same events' rows into the events
// table alone, built beforehand: the floor Write is measured against.
// Both report rows/s, counting events.
//
//	go test -run '^$' -bench BenchmarkWrite ./projections/chstore/
func BenchmarkWrite(b *testing.B) {
	g := projectionstest.NewGenerator(projectionstest.LogConfig{Seed: 11, Calls: 2000})
	var batch projections.Batch
	for i := range g.Calls() {
		for _, e := range g.Call(i) {
			batch.Events = append(batch.Events, projections.Event{Event: e, Offset: int64(len(batch.Events))})
		}
	}
	n := len(batch.Events)
	ctx := context.Background()

	b.Run("raw", func(b *testing.B) {
		s := openStore(b)
		r := make(tableRows)
		for _, e := range batch.Events {
			if err := eventRows(r, e); err != nil {
				b.Fatal(err)
			}
		}
		evRows := r[eventsTable.name]
		b.ReportAllocs()
		b.ResetTimer()
		for b.Loop() {
			if err := s.insert(ctx, eventsTable, evRows); err != nil {
				b.Fatal(err)
			}
		}
		b.ReportMetric(float64(n*b.N)/b.Elapsed().Seconds(), "rows/s")
	})
	b.Run("write", func(b *testing.B) {
		s := openStore(b)
		b.ReportAllocs()
		b.ResetTimer()
		for b.Loop() {
			if err := s.Write(ctx, batch); err != nil {
				b.Fatal(err)
			}
		}
		b.ReportMetric(float64(n*b.N)/b.Elapsed().Seconds(), "rows/s")
	})
	// As the projector writes a batch to a sink that records where it
	// ends: the ends read first, then the rows and the ends of twelve
	// partitions written. Against write: what the check of a restored
	// database costs a batch.
	positioned := batch
	for p := range int32(12) {
		positioned.Ends = append(positioned.Ends, projections.End{Topic: "toolcalls.events", Partition: p, Next: int64(n)})
	}
	b.Run("write_positioned", func(b *testing.B) {
		s := openStore(b)
		b.ReportAllocs()
		b.ResetTimer()
		for b.Loop() {
			if _, err := s.Positions(ctx); err != nil {
				b.Fatal(err)
			}
			if err := s.Write(ctx, positioned); err != nil {
				b.Fatal(err)
			}
		}
		b.ReportMetric(float64(n*b.N)/b.Elapsed().Seconds(), "rows/s")
	})
}

// BenchmarkQueries measures each question over a generated log of
// benchCalls calls (about four events each), written once.
func BenchmarkQueries(b *testing.B) {
	const benchCalls = 20000
	cfg := projectionstest.LogConfig{Seed: 13, Calls: benchCalls, Span: 24 * time.Hour}
	g := projectionstest.NewGenerator(cfg)
	s := openStore(b)
	ctx := context.Background()
	var (
		batch projections.Batch
		key   ledger.CallKey
		jti   string
	)
	for i := range g.Calls() {
		for _, e := range g.Call(i) {
			batch.Events = append(batch.Events, projections.Event{Event: e})
			if i == benchCalls/2 {
				key = e.Key()
				if e.JTI != "" {
					jti = e.JTI
				}
			}
		}
		if len(batch.Events) >= 50000 || i == g.Calls()-1 {
			if err := s.Write(ctx, batch); err != nil {
				b.Fatal(err)
			}
			batch = projections.Batch{}
		}
	}
	mid := time.Date(2026, 11, 30, 22, 0, 0, 0, time.UTC)
	for _, q := range []struct {
		name string
		ask  func() error
	}{
		{"trace", func() error { _, err := s.Trace(ctx, key); return err }},
		{"blast_radius/jti", func() error {
			_, err := s.BlastRadius(ctx, projections.Filter{AllTenants: true, JTI: jti})
			return err
		}},
		{"blast_radius/policy_version", func() error {
			_, err := s.BlastRadius(ctx, projections.Filter{AllTenants: true, PolicyVersion: "v50"})
			return err
		}},
		{"blast_radius/tenant", func() error {
			_, err := s.BlastRadius(ctx, projections.Filter{Tenant: "t_01"})
			return err
		}},
		{"blast_radius/tool_hour", func() error {
			_, err := s.BlastRadius(ctx, projections.Filter{AllTenants: true, Tool: "refund_order", Since: mid, Until: mid.Add(time.Hour)})
			return err
		}},
		{"outcomes", func() error {
			_, err := s.Outcomes(ctx, projections.Filter{AllTenants: true, Since: mid.Add(-12 * time.Hour), Until: mid.Add(12 * time.Hour)}, time.Hour)
			return err
		}},
		{"unresolved", func() error {
			_, err := s.Unresolved(ctx, projections.Filter{AllTenants: true, Limit: 100})
			return err
		}},
	} {
		b.Run(q.name, func(b *testing.B) {
			for b.Loop() {
				if err := q.ask(); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}
