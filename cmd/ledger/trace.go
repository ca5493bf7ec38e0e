package main

import (
	"errors"
	"fmt"

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
		Short: "Print a call's events (KEY is the idempotency key, or <tenant_id>/<idempotency_key>): from the ClickHouse projection when --clickhouse-dsn is set, else from the log",
		Args:  cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			key := ledger.CallKey{TenantID: tenant, IdempotencyKey: args[0]}
			if k, err := ledger.ParseCallKey(args[0]); err == nil && !cmd.Flags().Changed("tenant") {
				key = k
			}
			var (
				evs  []ledger.Event
				from string
				err  error
			)
			if ch.dsn != "" {
				st, oerr := ch.open(cmd.Context(), g.logger())
				if oerr != nil {
					return oerr
				}
				defer st.Close()
				evs, err = st.Trace(cmd.Context(), key)
				from = "the ClickHouse projection"
			} else {
				evs, err = ledger.ReadCall(cmd.Context(), g.kafka.client(g.logger()), g.kafka.events, key)
				from = g.kafka.events
			}
			if err != nil && !errors.Is(err, projections.ErrNotFound) {
				return err
			}
			if len(evs) == 0 {
				return fmt.Errorf("no events for %s in %s", key, from)
			}
			if jsonOut {
				return printJSONTo(cmd.OutOrStdout(), evs)
			}
			return report.EventsTable(cmd.OutOrStdout(), evs)
		},
	}
	cmd.Flags().StringVar(&tenant, "tenant", "t_demo", "tenant id of the call")
	cmd.Flags().BoolVar(&jsonOut, "json", false, "print the events as JSON")
	ch.register(cmd.Flags())
	return cmd
}
