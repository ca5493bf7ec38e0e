package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"maps"
	"net/http"
	"slices"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/ClickHouse/clickhouse-go/v2"
	"github.com/spf13/cobra"
	"github.com/spf13/pflag"

	"github.com/toolcall-ledger/ledger/processors/identity"
	"github.com/toolcall-ledger/ledger/projections"
	"github.com/toolcall-ledger/ledger/projections/chstore"
	"github.com/toolcall-ledger/ledger/projections/httpapi"
	"github.com/toolcall-ledger/ledger/projections/report"
	"github.com/toolcall-ledger/ledger/statemachine"
)

// clickhouseFlags name the ClickHouse projection.
type clickhouseFlags struct {
	dsn      string
	database string
	// questionMiB is chstore.Config.QuestionMaxMemory in MiB.
	questionMiB int64
}

func (c *clickhouseFlags) register(fs *pflag.FlagSet) {
	fs.StringVar(&c.dsn, "clickhouse-dsn", "", "ClickHouse of the projection (native protocol), e.g. clickhouse://default@127.0.0.1:9000/ledger; empty: the embedded projection of 'ledger dev'")
	fs.StringVar(&c.database, "clickhouse-database", "", "ClickHouse database of the projection's tables (default: the DSN's, else ledger)")
	c.registerLimits(fs)
}

// registerLimits registers the flags bounding the responders' questions.
func (c *clickhouseFlags) registerLimits(fs *pflag.FlagSet) {
	fs.Int64Var(&c.questionMiB, "clickhouse-question-max-memory-mib", chstore.DefaultQuestionMaxMemory>>20,
		"memory ClickHouse may use for each query of a responder's question (max_memory_usage; a blast radius asks two at once), in MiB; a question that needs more is answered 422 question_too_large; -1: the server's own limit")
}

// check refuses flags that no attempt to open could mend.
func (c *clickhouseFlags) check() error {
	if c.dsn == "" {
		return fmt.Errorf("--clickhouse-dsn (or LEDGER_CLICKHOUSE_DSN) is required")
	}
	if _, err := clickhouse.ParseDSN(c.dsn); err != nil {
		// Not echoed: it may hold a password.
		return errors.New("--clickhouse-dsn: cannot parse the DSN")
	}
	return nil
}

func (c *clickhouseFlags) open(ctx context.Context, logger *slog.Logger) (*chstore.Store, error) {
	if err := c.check(); err != nil {
		return nil, err
	}
	mem := c.questionMiB << 20
	if c.questionMiB < 0 {
		mem = -1
	}
	return chstore.Open(ctx, chstore.Config{DSN: c.dsn, Database: c.database, QuestionMaxMemory: mem, MaxConns: clickhouseConns, Logger: logger})
}

// clickhouseConns is the connections a store of the responders' questions
// and the agents' lookups may open at once: as many as they run at once
// (a blast radius asks two queries together), and a few more, so that a
// readiness check's ping never waits behind them (with clickhouse-go's
// 10, five broad questions of one tenant failed every api's readiness).
const clickhouseConns = 2*httpapi.DefaultMaxQuestions + httpapi.DefaultMaxLookups + 4

// queryFlags say where the responders' questions are answered: ClickHouse
// when a DSN is given, else a ledger's query API (that of `ledger dev` by
// default, with an operator assertion its dev issuer mints).
type queryFlags struct {
	ch        clickhouseFlags
	api       string
	assertion string
	dataDir   string
	user      string
	jsonOut   bool
	csvOut    bool
}

func (q *queryFlags) register(fs *pflag.FlagSet) {
	q.ch.register(fs)
	fs.StringVar(&q.api, "api", "http://"+devHTTPAddr, "the ledger's HTTP API, asked when there is no --clickhouse-dsn: https, or http on loopback only (the requests carry the assertion)")
	fs.StringVar(&q.assertion, "assertion", "", "an operator's assertion for --api; default: minted by the dev issuer in --data-dir")
	fs.StringVar(&q.dataDir, "data-dir", devDataDir, "data directory of 'ledger dev', whose dev issuer mints the operator's assertion")
	// dev takes its directory from its command line alone: so does
	// whatever finds dev's issuer in it.
	ignoreEnv(fs, "data-dir")
	fs.StringVar(&q.user, "as-user", "u_responder", "the operator, for a dev assertion")
	fs.BoolVar(&q.jsonOut, "json", false, "print JSON")
	fs.BoolVar(&q.csvOut, "csv", false, "print CSV")
}

// open returns the queries, through the ledger's HTTP client settings
// (hc) when they are asked of --api, and a function to release them.
func (q *queryFlags) open(ctx context.Context, logger *slog.Logger, hc *httpClientFlags) (projections.Queries, func(), error) {
	if q.jsonOut && q.csvOut {
		return nil, nil, fmt.Errorf("--json and --csv: choose one")
	}
	if q.ch.dsn != "" {
		st, err := q.ch.open(ctx, logger)
		if err != nil {
			return nil, nil, err
		}
		return st, func() { st.Close() }, nil
	}
	if err := checkAssertionURL(q.api); err != nil {
		return nil, nil, err
	}
	cl, err := hc.client(logger, 0)
	if err != nil {
		return nil, nil, err
	}
	return &httpapi.QueryClient{Base: q.api, Bearer: q.bearer, HTTP: cl}, func() {}, nil
}

// bearer returns the operator's assertion for a question about tenant.
func (q *queryFlags) bearer(tenant string) (string, error) {
	if q.assertion != "" {
		return q.assertion, nil
	}
	iss, err := devIssuer(q.dataDir)
	if err != nil {
		return "", fmt.Errorf("no --assertion, and %v", err)
	}
	return iss.Mint(identity.Identity{Tenant: tenant, User: q.user, Agent: "responder_cli", Roles: []string{"operator"}}, identity.ApproverAudience, 5*time.Minute)
}

// print writes v as JSON, or with the table or CSV writer given.
func (q *queryFlags) print(w io.Writer, v any, table, csv func(io.Writer) error) error {
	switch {
	case q.jsonOut:
		return printJSONTo(w, v)
	case q.csvOut && isTerminal(w):
		// Cells hold what agents sent (a resource, a call id): the
		// raw escapes a file should keep would clear or repaint the
		// responder's screen.
		var b bytes.Buffer
		if err := csv(&b); err != nil {
			return err
		}
		_, err := w.Write(report.TerminalText(b.Bytes()))
		return err
	case q.csvOut:
		return csv(w)
	}
	return table(w)
}

// filterFlags are a Filter's flags.
type filterFlags struct {
	f            projections.Filter
	since, until string
}

func (ff *filterFlags) register(fs *pflag.FlagSet, refs bool) {
	fs.StringVar(&ff.f.Tenant, "tenant", "", "the tenant asked about (one of --tenant and --all-tenants is required)")
	fs.BoolVar(&ff.f.AllTenants, "all-tenants", false, "ask across every tenant (a platform operator's question)")
	fs.StringVar(&ff.f.Tool, "tool", "", "only calls of this tool")
	if !refs {
		return
	}
	fs.StringVar(&ff.f.JTI, "jti", "", "calls that used this credential")
	fs.StringVar(&ff.f.CredentialFamily, "credential-family", "", "calls that used a credential of this family (<tool>:<tenant>:<key epoch>)")
	fs.StringVar(&ff.f.PolicyVersion, "policy-version", "", "calls decided under this policy version: its label (v41: every version of that label) or label@hash as events carry it")
	fs.StringVar(&ff.f.Role, "role", "", "calls decided with this role among the caller's roles the policies were given (--policy-roles; calls decided without it match no role)")
	fs.StringVar(&ff.f.Decision, "decision", "", "with --policy-version or --role: only those allow, deny or require_approval decisions")
	fs.StringVar(&ff.f.Approver, "approver", "", "calls this approver decided")
	fs.StringVar(&ff.f.ApprovalID, "approval-id", "", "the call of this approval")
	fs.StringVar(&ff.f.CallID, "call-id", "", "the call of this call id")
	fs.StringVar(&ff.f.TraceID, "trace-id", "", "the calls of this trace")
	fs.StringVar(&ff.f.ToolDigest, "tool-digest", "", "calls admitted under this tool definition: its digest (sha256:...) as events carry it (tool_digest; the requested event in the window)")
	states := make([]string, 0, len(statemachine.States))
	for _, st := range statemachine.States {
		if st != statemachine.StateNone {
			states = append(states, string(st))
		}
	}
	fs.StringVar((*string)(&ff.f.State), "state", "", "only the matched calls whose state now is this one: "+strings.Join(states, ", "))
}

// registerLimit registers --limit, of a question that lists calls.
func (ff *filterFlags) registerLimit(fs *pflag.FlagSet) {
	fs.IntVar(&ff.f.Limit, "limit", 0, fmt.Sprintf("list at most this many calls (default %d; counts cover all)", projections.DefaultLimit))
}

func (ff *filterFlags) registerWindow(fs *pflag.FlagSet) {
	fs.StringVar(&ff.since, "since", "", "from this time: RFC 3339, or a duration ago such as 2h or 7d")
	fs.StringVar(&ff.until, "until", "", "until this time (excluded): RFC 3339, or a duration ago")
}

func (ff *filterFlags) filter(now time.Time) (projections.Filter, error) {
	f := ff.f
	var err error
	if f.Since, err = projections.ParseTime(ff.since, now); err != nil {
		return f, fmt.Errorf("--since: %w", err)
	}
	if f.Until, err = projections.ParseTime(ff.until, now); err != nil {
		return f, fmt.Errorf("--until: %w", err)
	}
	return f, nil
}

// answer is what a query command prints: the value as JSON, or its table
// or CSV form.
type answer struct {
	v          any
	table, csv func(io.Writer) error
	// note, if set, goes to stderr after the answer: what its list left
	// out, which the CSV form has no room for.
	note string
}

// queryCmd is a command asking one question of the projection: ask gets
// the filter from the flags and the queries from --clickhouse-dsn or --api.
// refs: the question may name a call's references (a jti, a policy
// version); window: a time window; lists: it lists calls, bounded by
// --limit.
func queryCmd(g *globals, cmd *cobra.Command, refs, window, lists bool, ask func(ctx context.Context, qs projections.Queries, f projections.Filter) (answer, error)) *cobra.Command {
	var (
		q  queryFlags
		ff filterFlags
	)
	cmd.Args = cobra.NoArgs
	cmd.RunE = func(cmd *cobra.Command, _ []string) error {
		f, err := ff.filter(time.Now())
		if err != nil {
			return err
		}
		qs, done, err := q.open(cmd.Context(), g.logger(), &g.httpClient)
		if err != nil {
			return err
		}
		defer done()
		a, err := ask(cmd.Context(), qs, f)
		if err != nil {
			return err
		}
		if err := q.print(cmd.OutOrStdout(), a.v, a.table, a.csv); err != nil {
			return err
		}
		if a.note != "" {
			fmt.Fprintln(cmd.ErrOrStderr(), a.note)
		}
		return nil
	}
	q.register(cmd.Flags())
	ff.register(cmd.Flags(), refs)
	if lists {
		ff.registerLimit(cmd.Flags())
	}
	if window {
		ff.registerWindow(cmd.Flags())
	}
	return cmd
}

func newBlastRadiusCmd(g *globals) *cobra.Command {
	return queryCmd(g, &cobra.Command{
		Use:   "blast-radius",
		Short: "What a credential, tool, policy version, approver, call or trace touched: the calls, tenants, resources and outcomes",
		Example: `  ledger blast-radius --jti 0193... --all-tenants
  ledger blast-radius --policy-version v41 --decision allow --since 2h --all-tenants --csv > v41.csv
  ledger blast-radius --tool refund_order --tenant t_demo --since 1h
  ledger blast-radius --trace-id 4bf92f35... --tenant t_demo
  ledger blast-radius --state outcome_unknown --tool refund_order --tenant t_demo --since 24h`,
	}, true, true, true, func(ctx context.Context, qs projections.Queries, f projections.Filter) (answer, error) {
		br, err := qs.BlastRadius(ctx, f)
		a := answer{v: br,
			table: func(w io.Writer) error { return report.BlastRadiusTable(w, br) },
			csv:   func(w io.Writer) error { return report.BlastRadiusCSV(w, br) }}
		a.note = blastNote(br)
		return a, err
	})
}

// blastNote is what a responder is told beside a blast radius whose list
// is not all of its calls: the limit cut it, or the projection took
// writes between the counts and the list.
func blastNote(br projections.BlastRadius) string {
	switch {
	case !br.Agrees():
		return fmt.Sprintf("warning: the counts (%d calls) and the list (%d) were read while the projection took writes, and disagree; ask again", br.Total, len(br.Calls))
	case br.Truncated:
		return fmt.Sprintf("warning: listed %d of the %d matching calls (--limit); the counts cover them all", len(br.Calls), br.Total)
	}
	return ""
}

func newOutcomesCmd(g *globals) *cobra.Command {
	var bucket time.Duration
	cmd := queryCmd(g, &cobra.Command{
		Use:   "outcomes",
		Short: "How many calls reached each outcome, by tool and time bucket",
		Example: `  ledger outcomes --tenant t_demo --since 24h --bucket 5m
  ledger outcomes --all-tenants --tool refund_order --since 2h --bucket 1s`,
	}, false, true, false, func(ctx context.Context, qs projections.Queries, f projections.Filter) (answer, error) {
		os, err := qs.Outcomes(ctx, f, bucket)
		return answer{v: os,
			table: func(w io.Writer) error { return report.OutcomesTable(w, os) },
			csv:   func(w io.Writer) error { return report.OutcomesCSV(w, os) }}, err
	})
	cmd.Flags().DurationVar(&bucket, "bucket", 5*time.Minute, fmt.Sprintf("bucket width (whole seconds); the window, --since (default: the epoch) to --until (default: now), may span at most %d buckets", projections.MaxOutcomeBuckets))
	return cmd
}

func newUnresolvedCmd(g *globals) *cobra.Command {
	return queryCmd(g, &cobra.Command{
		Use:   "unresolved",
		Short: "Calls waiting on someone: outcome unknown (parked or being reconciled) and pending approvals, oldest first",
	}, false, false, true, func(ctx context.Context, qs projections.Queries, f projections.Filter) (answer, error) {
		calls, err := qs.Unresolved(ctx, f)
		a := answer{v: calls,
			table: func(w io.Writer) error { return report.CallsTable(w, calls) },
			csv:   func(w io.Writer) error { return report.CallsCSV(w, calls) }}
		if f.Full(len(calls)) {
			a.note = fmt.Sprintf("warning: listed %d calls, the limit (--limit): more may be waiting", len(calls))
		}
		return a, err
	})
}

// operatorGuard authenticates the query API's operators with the staff
// verifier: their assertion as Authorization: Bearer.
func operatorGuard(v identity.AssertionVerifier, logger *slog.Logger) httpapi.Guard {
	return func(next func(http.ResponseWriter, *http.Request, httpapi.Operator)) http.HandlerFunc {
		return identity.Require(v, "ledger-queries", "an operator", logger, func(w http.ResponseWriter, r *http.Request, id identity.Identity) {
			next(w, r, httpapi.Operator{User: id.User, Tenant: id.Tenant, Roles: id.Roles})
		})
	}
}

// printJSONTo writes v as indented JSON, for a terminal: what one would
// not show as it is (an agent's C1 controls, bidi overrides, zero-width
// runes in a call id, a resource, arguments) escaped (report.TerminalJSON),
// the same JSON to a reader.
func printJSONTo(w io.Writer, v any) error {
	b, err := json.MarshalIndent(v, "", "  ")
	if err != nil {
		return err
	}
	_, err = w.Write(append(report.TerminalJSON(b), '\n'))
	return err
}

// printChecksums writes a projection's checksums, one table a line.
func printChecksums(w io.Writer, sums map[string]chstore.Checksum) {
	names := slices.Sorted(maps.Keys(sums))
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "TABLE\tROWS\tCHECKSUM")
	for _, n := range names {
		fmt.Fprintf(tw, "%s\t%d\t%016x\n", n, sums[n].Rows, sums[n].Sum)
	}
	tw.Flush()
}

// printEnds says where a projection's records end (its positions), a line
// a topic: two projections' checksums compare only where they end alike.
func printEnds(w io.Writer, pos projections.Positions) {
	for _, topic := range slices.Sorted(maps.Keys(pos)) {
		var b strings.Builder
		for _, partition := range slices.Sorted(maps.Keys(pos[topic])) {
			fmt.Fprintf(&b, " %d:%d", partition, pos[topic][partition])
		}
		fmt.Fprintf(w, "ends %s%s\n", topic, b.String())
	}
}

// endsDiffer counts the partitions where a and b end differently, or only
// one of them says where.
func endsDiffer(a, b projections.Positions) int {
	n := 0
	for topic, parts := range a {
		for partition, next := range parts {
			if other, ok := b.Lookup(topic, partition); !ok || other != next {
				n++
			}
		}
	}
	for topic, parts := range b {
		for partition := range parts {
			if _, ok := a.Lookup(topic, partition); !ok {
				n++
			}
		}
	}
	return n
}

// mountQueries serves the responders' questions on mux, from qs, to the
// operators staff verifies.
func mountQueries(mux *http.ServeMux, qs projections.Queries, staff identity.AssertionVerifier, logger *slog.Logger) error {
	h, err := httpapi.QueryHandler(httpapi.QueryConfig{
		Queries: qs, Guard: operatorGuard(staff, logger), Logger: logger.With("component", "queries"),
	})
	if err != nil {
		return err
	}
	for _, p := range []string{httpapi.PathBlastRadius, httpapi.PathOutcomes, httpapi.PathUnresolved, httpapi.PathTrace} {
		mux.Handle(p, h)
	}
	return nil
}
