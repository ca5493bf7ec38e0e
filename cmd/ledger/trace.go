package main

import (
	"encoding/json"
	"fmt"
	"io"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"

	"github.com/toolcall-ledger/ledger/ledger"
	"github.com/toolcall-ledger/ledger/statemachine"
)

func newTraceCmd(g *globals) *cobra.Command {
	var (
		tenant  string
		jsonOut bool
	)
	cmd := &cobra.Command{
		Use:   "trace KEY",
		Short: "Print a call's events from the log (KEY is the idempotency key, or <tenant_id>/<idempotency_key>)",
		Args:  cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			key := ledger.CallKey{TenantID: tenant, IdempotencyKey: args[0]}
			if k, err := ledger.ParseCallKey(args[0]); err == nil && !cmd.Flags().Changed("tenant") {
				key = k
			}
			evs, err := ledger.ReadCall(cmd.Context(), g.kafka.client(g.logger()), g.kafka.events, key)
			if err != nil {
				return err
			}
			if len(evs) == 0 {
				return fmt.Errorf("no events for %s in %s", key, g.kafka.events)
			}
			if jsonOut {
				enc := json.NewEncoder(cmd.OutOrStdout())
				enc.SetIndent("", "  ")
				return enc.Encode(evs)
			}
			printEvents(cmd.OutOrStdout(), evs)
			return nil
		},
	}
	cmd.Flags().StringVar(&tenant, "tenant", "t_demo", "tenant id of the call")
	cmd.Flags().BoolVar(&jsonOut, "json", false, "print the events as JSON")
	return cmd
}

func printEvents(w io.Writer, evs []ledger.Event) {
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "SEQ\tTYPE\tAT\tACTOR\tATTEMPT\tNOTE")
	for _, e := range evs {
		seq := fmt.Sprint(e.Seq)
		if e.Refusal() {
			seq = "-"
		}
		attempt := ""
		if e.Attempt > 0 {
			attempt = fmt.Sprint(e.Attempt)
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\n", seq, e.Type, e.At.Format(time.RFC3339Nano), e.Actor, attempt, eventNote(e))
	}
	tw.Flush()
}

// eventNote is the one-line gist of an event for humans.
func eventNote(e ledger.Event) string {
	var parts []string
	if e.Refusal() {
		parts = append(parts, "refused submission")
	}
	if e.Reason != "" {
		parts = append(parts, "reason="+e.Reason)
	}
	if e.Type == statemachine.EventRequested || e.Type == statemachine.EventApproved {
		parts = append(parts, "hash="+short(e.ArgumentsHash))
	}
	if e.PolicyVersion != "" && e.Type != statemachine.EventExecuting {
		parts = append(parts, "policy="+e.PolicyVersion)
	}
	if e.Approver != "" {
		parts = append(parts, "approver="+e.Approver)
	}
	if e.ApprovalID != "" && e.Type != statemachine.EventExecuting {
		parts = append(parts, "approval="+e.ApprovalID)
	}
	if e.JTI != "" && e.Type != statemachine.EventExecuting {
		parts = append(parts, "jti="+e.JTI)
	}
	if e.Pointer != "" {
		parts = append(parts, "pointer="+e.Pointer)
	}
	if e.ErrorCode != "" {
		parts = append(parts, "error="+e.ErrorCode)
	}
	if e.LatencyMS > 0 {
		parts = append(parts, fmt.Sprintf("latency=%dms", e.LatencyMS))
	}
	if e.ResultDigest != "" {
		parts = append(parts, "result="+short(e.ResultDigest))
	}
	return strings.Join(parts, " ")
}

// short abbreviates a "sha256:<hex>" digest for a table.
func short(digest string) string {
	if len(digest) <= 19 {
		return digest
	}
	return digest[:19] + "…"
}
