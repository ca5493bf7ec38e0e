package main

import (
	"errors"
	"fmt"
	"strings"

	"github.com/spf13/cobra"

	"github.com/toolcall-ledger/ledger/ledger"
	"github.com/toolcall-ledger/ledger/projections"
	"github.com/toolcall-ledger/ledger/projections/report"
)

func newTraceCmd(g *globals) *cobra.Command {
	var (
		tenant  string
		jsonOut bool
		ch      clickhouseFlags
	)
	cmd := &cobra.Command{
		Use:   "trace KEY",
		Short: "Print a call's events (KEY is the idempotency key, or <tenant_id>/<idempotency_key>, or, when no such call is found, a key of --tenant holding a \"/\"): from the ClickHouse projection when --clickhouse-dsn is set, else from the log",
		Args:  cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			keys := []ledger.CallKey{{TenantID: tenant, IdempotencyKey: args[0]}}
			if k, err := ledger.ParseCallKey(args[0]); err == nil && !cmd.Flags().Changed("tenant") {
				// <tenant_id>/<key> first; then, a key may hold a "/",
				// the whole of it as the tenant's.
				keys = []ledger.CallKey{k, keys[0]}
			}
			from := g.kafka.events
			trace := func(key ledger.CallKey) ([]ledger.Event, error) {
				return ledger.ReadCall(cmd.Context(), g.kafka.client(g.logger()), g.kafka.events, key)
			}
			if ch.dsn != "" {
				st, err := ch.open(cmd.Context(), g.logger())
				if err != nil {
					return err
				}
				defer st.Close()
				from, trace = "the ClickHouse projection", func(key ledger.CallKey) ([]ledger.Event, error) { return st.Trace(cmd.Context(), key) }
			}
			var tried []string
			for i, key := range keys {
				evs, err := trace(key)
				if err != nil && !errors.Is(err, projections.ErrNotFound) {
					return err
				}
				if len(evs) == 0 {
					tried = append(tried, key.String())
					continue
				}
				if i > 0 {
					// Not the reading KEY has as <tenant_id>/<key>.
					fmt.Fprintf(cmd.ErrOrStderr(), "no call %s; call %s (tenant %s)\n", keys[0], key, key.TenantID)
				}
				if ch.dsn != "" {
					if note := refusalsCut(evs); note != "" {
						fmt.Fprintln(cmd.ErrOrStderr(), note)
					}
				}
				if jsonOut {
					return printJSONTo(cmd.OutOrStdout(), evs)
				}
				return report.EventsTable(cmd.OutOrStdout(), evs)
			}
			return fmt.Errorf("no events for %s in %s", strings.Join(tried, " nor for "), from)
		},
	}
	cmd.Flags().StringVar(&tenant, "tenant", "t_demo", "tenant id of the call")
	cmd.Flags().BoolVar(&jsonOut, "json", false, "print the events as JSON")
	ch.register(cmd.Flags())
	return cmd
}

// refusalsCut is the note of a trace from the projection that holds as
// many refused submissions under the key as the projection keeps
// (projections.MaxRefusals, the earliest and the latest): those between
// are not shown, and the log has them all.
func refusalsCut(evs []ledger.Event) string {
	n, full := projections.RefusalsFull(evs)
	if !full {
		return ""
	}
	return fmt.Sprintf("note: %d refused submissions shown, the earliest and the latest, as many as the projection keeps under a key; those between are not: ledger trace without --clickhouse-dsn reads them all from the log", n)
}
