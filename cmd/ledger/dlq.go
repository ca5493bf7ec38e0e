package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"maps"
	"slices"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/spf13/cobra"

	"github.com/toolcall-ledger/ledger/ledger"
	"github.com/toolcall-ledger/ledger/projections/report"
)

// newDLQCmd reads the DLQ: the requests the intake could not read, and the
// batches it skipped unread, each with why. Without it the records were
// there for a Kafka client of one's own only, and the operator learned of
// them from a metric and a log line.
func newDLQCmd(g *globals) *cobra.Command {
	var (
		since   time.Duration
		follow  bool
		reason  string
		values  bool
		jsonOut bool
	)
	cmd := &cobra.Command{
		Use:   "dlq",
		Short: "Print the DLQ's records: each unreadable request's reason, detail and where it came from (--value: the request too, tokens redacted); --follow to go on with those written after (with --since 1s: only those)",
		Example: `  ledger dlq --since 1h
  ledger dlq --reason invalid_json --value --json
  ledger dlq --follow`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if since < 0 {
				return fmt.Errorf("--since %s: must not be negative", since)
			}
			var from time.Time
			if since > 0 {
				from = time.Now().Add(-since)
			}
			out := cmd.OutOrStdout()
			counts := map[string]int{}
			err := ledger.ReadDLQ(cmd.Context(), g.kafka.client(g.logger()), g.kafka.dlq, from, follow, func(e ledger.DLQEntry) bool {
				if reason != "" && e.Reason != reason {
					return false
				}
				counts[e.Reason]++
				if jsonOut {
					printDLQJSON(out, e, values)
				} else {
					printDLQEntry(out, g.kafka.dlq, e, values)
				}
				return false
			})
			if follow && errors.Is(err, context.Canceled) {
				// Interrupted, as --follow ends.
				err = nil
			}
			if err != nil {
				return fmt.Errorf("read %s: %w", g.kafka.dlq, err)
			}
			if !jsonOut {
				fmt.Fprintln(out, dlqSummary(g.kafka.dlq, reason, since, counts))
			}
			return nil
		},
	}
	cmd.Flags().DurationVar(&since, "since", 0, "only records written within this long (default: every record the topic holds)")
	cmd.Flags().BoolVar(&follow, "follow", false, "after the records the topic holds (or those --since lets through), go on printing records as they are written, until interrupted")
	cmd.Flags().StringVar(&reason, "reason", "", "only records of this reason (invalid_json, batch_too_large, ...)")
	cmd.Flags().BoolVar(&values, "value", false, "print each request's copy too (tokens in it are redacted, but its arguments are as the agent sent them)")
	cmd.Flags().BoolVar(&jsonOut, "json", false, "print a JSON object a line")
	return cmd
}

// printDLQEntry prints e as lines for a person, what is not printable in
// the request's words escaped: the DLQ holds whatever reached the request
// topic.
func printDLQEntry(w io.Writer, topic string, e ledger.DLQEntry, value bool) {
	fmt.Fprintf(w, "%s  %s/%d@%d  %s", e.Time.UTC().Format(time.RFC3339Nano), topic, e.Partition, e.Offset, report.Printable(e.Reason))
	if e.Source != "" {
		fmt.Fprintf(w, "  from %s", report.Printable(e.Source))
	}
	if e.TruncatedFrom > 0 {
		fmt.Fprintf(w, "  (its copy cut from %d bytes)", e.TruncatedFrom)
	}
	fmt.Fprintln(w)
	if e.Detail != "" {
		fmt.Fprintf(w, "    %s\n", report.Printable(e.Detail))
	}
	if value && len(e.Value) > 0 {
		fmt.Fprintf(w, "    request: %s\n", report.Printable(strings.ToValidUTF8(string(e.Value), "\uFFFD")))
	}
}

// dlqJSON is a DLQ record as --json prints it.
type dlqJSON struct {
	Partition     int32     `json:"partition"`
	Offset        int64     `json:"offset"`
	Time          time.Time `json:"time"`
	Reason        string    `json:"reason"`
	Detail        string    `json:"detail,omitempty"`
	Source        string    `json:"source,omitempty"`
	TruncatedFrom int64     `json:"truncated_from,omitempty"`
	// Value is the request's copy when it is UTF-8, else ValueBase64.
	Value       *string `json:"value,omitempty"`
	ValueBase64 []byte  `json:"value_base64,omitempty"`
}

func printDLQJSON(w io.Writer, e ledger.DLQEntry, value bool) {
	j := dlqJSON{Partition: e.Partition, Offset: e.Offset, Time: e.Time.UTC(), Reason: e.Reason, Detail: e.Detail, Source: e.Source, TruncatedFrom: e.TruncatedFrom}
	if value && len(e.Value) > 0 {
		if utf8.Valid(e.Value) {
			v := string(e.Value)
			j.Value = &v
		} else {
			j.ValueBase64 = e.Value
		}
	}
	b, err := json.Marshal(j)
	if err != nil {
		fmt.Fprintf(w, "{\"error\":%q}\n", err.Error())
		return
	}
	w.Write(append(report.TerminalJSON(b), '\n'))
}

// dlqSummary says how many records of topic were printed, by reason, and
// which (of reason, written within since, when set).
func dlqSummary(topic, reason string, since time.Duration, counts map[string]int) string {
	which := topic
	if reason != "" {
		which += ", reason " + report.Printable(reason)
	}
	if since > 0 {
		which += ", written in the last " + since.String()
	}
	total := 0
	var by []string
	for _, r := range slices.Sorted(maps.Keys(counts)) {
		total += counts[r]
		by = append(by, fmt.Sprintf("%s %d", report.Printable(r), counts[r]))
	}
	if total == 0 {
		return "no records (" + which + ")"
	}
	return fmt.Sprintf("%d records (%s): %s", total, which, strings.Join(by, ", "))
}
