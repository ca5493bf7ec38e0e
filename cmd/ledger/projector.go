package main

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"os"
	"strings"
	"time"

	"github.com/spf13/cobra"
	"golang.org/x/sync/errgroup"

	"github.com/toolcall-ledger/ledger/ledger"
	"github.com/toolcall-ledger/ledger/processors/metrics"
	"github.com/toolcall-ledger/ledger/projections"
	"github.com/toolcall-ledger/ledger/projections/chstore"
	"github.com/toolcall-ledger/ledger/projections/projector"
)

func newProjectorCmd(g *globals) *cobra.Command {
	var (
		ch          clickhouseFlags
		group       string
		metricsAddr string
		batch       int
		wait        time.Duration
		idf         identityFlags
	)
	cmd := &cobra.Command{
		Use:   "projector",
		Short: "Project the events and control topics into ClickHouse, for the incident-response queries",
		Long: `projector consumes the events and control topics (read_committed) and
batch-inserts them into ClickHouse; it commits its offsets only once ClickHouse
accepted the batch, so a crash re-inserts a batch at worst, which changes no
answer. Its lag (records and seconds) is at --metrics-addr/metrics and from
` + "`ledger projector status`" + `. Run ` + "`ledger projector migrate`" + ` first.

With --issuer and --jwks-*, the same address also serves the responders'
questions from ClickHouse to operators: GET /v1/blast-radius, /v1/outcomes,
/v1/unresolved and /v1/trace/<tenant>/<key>.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			ctx := cmd.Context()
			logger := g.logger()
			st, err := ch.open(ctx, logger.With("component", "chstore"))
			if err != nil {
				return err
			}
			defer st.Close()
			if err := checkSchema(ctx, st); err != nil {
				return err
			}
			if _, gap, err := projectionGap(ctx, st, g.kafka.client(logger), g.kafka.topics(), group); err != nil {
				return err
			} else if gap {
				return fmt.Errorf("clickhouse database %s holds no events (or no control actions), but group %s has committed offsets on that topic past the start of its log: projecting from there would leave out everything before. If a restore of the database is in progress, start the projector once it is done; else run `ledger projector rebuild --swap` (with the projector stopped), or delete the group", st.Database(), group)
			}
			if lost, err := startOffsets(ctx, st, g.kafka.client(logger), g.kafka.topics(), group); err != nil {
				return err
			} else if len(lost) > 0 {
				return fmt.Errorf("clickhouse database %s holds the projection, but group %s has no committed offset on %s: its offsets expired or were deleted (or, for a group of a build before this check, the partition's records were all deleted before a projector read any), and records the log deleted may be missing from the projection. To compare it with what the log still holds, `ledger projector rebuild` (without --swap) prints the rebuilt tables' checksums and `ledger projector checksums` the live ones; then run `ledger projector skip-deleted` to go on from the log's start", st.Database(), group, strings.Join(lost, ", "))
			}
			p, err := projector.New(projector.Config{
				Client: g.kafka.client(logger), Topics: g.kafka.topics(), Group: group,
				MaxBatch: batch, MaxWait: wait, Logger: logger.With("component", "projector"),
			}, st)
			if err != nil {
				return err
			}
			grp, ctx := errgroup.WithContext(ctx)
			if metricsAddr != "" {
				mux := http.NewServeMux()
				mux.Handle("GET /metrics", metrics.Serve(p))
				if idf.issuer != "" {
					staff, err := idf.verifier(ctx, logger)
					if err != nil {
						return err
					}
					// The questions get a store of their own, and so a
					// connection pool of their own: scans of the
					// history must never wait for, or hold up, the
					// connections the projector's inserts use.
					qs, err := ch.open(ctx, logger.With("component", "chstore-queries"))
					if err != nil {
						return err
					}
					defer qs.Close()
					if err := mountQueries(mux, qs, staff, logger); err != nil {
						return err
					}
				}
				mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, r *http.Request) {
					if err := st.Ping(r.Context()); err != nil {
						logger.Warn("health check", "err", err)
						http.Error(w, "clickhouse does not answer", http.StatusServiceUnavailable)
						return
					}
					fmt.Fprintln(w, "ok")
				})
				if _, err := g.serve(ctx, grp, "metrics", metricsAddr, mux); err != nil {
					return err
				}
			}
			grp.Go(func() error {
				err := p.Run(ctx)
				if errors.Is(err, projector.ErrRecordsDeleted) {
					return fmt.Errorf("%w; the projection will never hold them: to go on without them, stop the projector and run `ledger projector skip-deleted`", err)
				}
				return err
			})
			logger.Info("projector running", "clickhouse", redactDSN(ch.dsn), "database", st.Database(), "metrics", metricsAddr)
			return grp.Wait()
		},
	}
	fs := cmd.PersistentFlags()
	ch.register(fs)
	fs.StringVar(&group, "group", projector.DefaultGroup, "the projector's consumer group")
	cmd.Flags().StringVar(&metricsAddr, "metrics-addr", "127.0.0.1:9464", "where /metrics, /healthz and (with --issuer) the query API are served; empty: nowhere")
	idf.registerStaff(cmd.Flags())
	cmd.Flags().IntVar(&batch, "batch", projector.DefaultMaxBatch, "records per ClickHouse insert, at most")
	cmd.Flags().DurationVar(&wait, "batch-wait", projector.DefaultMaxWait, "how long a batch waits to fill before it is inserted")

	migrate := &cobra.Command{
		Use:   "migrate",
		Short: "Create or upgrade the projection's ClickHouse tables (idempotent)",
		Args:  cobra.NoArgs,
		RunE: ch.with(g, func(cmd *cobra.Command, st *chstore.Store) error {
			fills, err := st.PendingFills(cmd.Context())
			if err != nil {
				return err
			}
			if len(fills) > 0 {
				// A projector of the older build writes rows the fill
				// would not see, and does not write what it fills in.
				s, err := projector.Status(cmd.Context(), projector.StatusConfig{Client: g.kafka.client(g.logger()), Topics: g.kafka.topics(), Group: group})
				if err != nil && !errors.Is(err, projector.ErrNeverCommitted) {
					return fmt.Errorf("migration %s fills rows in, or adds a column that an older projector leaves empty, so no projector may run meanwhile, and group %s cannot be checked: %w", strings.Join(fills, ", "), group, err)
				}
				if s.Members > 0 {
					return fmt.Errorf("migration %s fills rows in, or adds a column that an older projector leaves empty, and group %s has %d members: rows a projector of the older build wrote meanwhile would stay without them. Stop the projector (scale it to 0), migrate, then start the new build", strings.Join(fills, ", "), group, s.Members)
				}
			}
			if err := st.Migrate(cmd.Context()); err != nil {
				return err
			}
			v, err := st.SchemaVersion(cmd.Context())
			if err != nil {
				return err
			}
			fmt.Fprintf(cmd.OutOrStdout(), "clickhouse database %s: schema version %d\n", st.Database(), v)
			return nil
		}),
	}

	var statusJSON bool
	status := &cobra.Command{
		Use:   "status",
		Short: "How far behind the log the projection is (records and seconds, per partition)",
		Long: `status reads the group's committed offsets and the topics' ends from Kafka.
With --clickhouse-dsn it also shows where the projection's records end in each
partition (PROJECTED), as the projection records it, and says so when that is
before the group's offset (a database restored from an older backup, whose
records a running projector reads again), or when the projection has no end of
a partition the group says it had one of (a restore in progress, or a database
restored from a backup without ends, or a new one: a projector holds the
partition; see record-ends).`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			ctx := cmd.Context()
			s, err := projector.Status(ctx, projector.StatusConfig{
				Client: g.kafka.client(g.logger()), Topics: g.kafka.topics(), Group: group,
			})
			if errors.Is(err, projector.ErrNeverCommitted) {
				// Still worth showing: the whole log is the lag.
				fmt.Fprintf(cmd.ErrOrStderr(), "group %s has committed no offset yet\n", group)
			} else if err != nil {
				return err
			}
			behind, held := 0, 0
			if ch.dsn != "" {
				st, err := ch.open(ctx, g.logger())
				if err != nil {
					return err
				}
				defer st.Close()
				// The lag stands without them (a database of an
				// older schema version has none).
				if pos, err := st.Positions(ctx); err != nil {
					fmt.Fprintf(cmd.ErrOrStderr(), "where the projection's records end is not shown: %v\n", err)
				} else {
					behind, held = s.SetEnds(pos)
				}
			}
			if statusJSON {
				return printJSONTo(cmd.OutOrStdout(), s)
			}
			fmt.Fprint(cmd.OutOrStdout(), s.String())
			if behind > 0 {
				fmt.Fprintf(cmd.OutOrStdout(), "the projection's records end before the group's offset on %d partitions (a database restored from an older backup?): a running projector reads them again\n", behind)
			}
			if held > 0 {
				fmt.Fprintf(cmd.OutOrStdout(), "the projection has no end of %d partitions the group committed with one (a restore in progress?): a projector holds them until it has; if the database, restored, has none (a backup from before ends were recorded, or a new database), run `ledger projector rebuild --swap`, or `ledger projector record-ends` to go on without what it lacks\n", held)
			}
			return nil
		},
	}
	status.Flags().BoolVar(&statusJSON, "json", false, "print JSON")

	var (
		into  string
		swap  bool
		force bool
	)
	rebuild := &cobra.Command{
		Use:   "rebuild",
		Short: "Replay the whole log into fresh tables, with progress; --swap puts them in place of the live ones",
		Long: `rebuild replays the events and control topics from the start of the log
(read_committed, up to their ends when it starts) into fresh tables in the
database --into (default: <database>_rebuild, emptied first), showing progress.
Only the projection's own tables in --into are replaced; nothing else there is
touched. It prints the checksums of the rebuilt tables: equal to the live ones'
when the live projection is caught up to the same offsets and the log still
holds everything (retention deletes old events; compaction keeps only the
latest control record per subject).

With --swap, stop the projector first: the rebuilt tables replace the live ones,
then the projector's group offsets are set to where the replay ended, so the
projector, started again, goes on from there. A rebuild lacking an event, or
the control actions of a subject, that the live tables hold (the log no longer
has them all) is not swapped in without --force. The control actions of the
live tables that the rebuild lacks (the compacted control topic keeps only each
subject's latest) are copied into it first: the table is the history an
incident's audit reads, and nothing else keeps it.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			ctx := cmd.Context()
			logger := g.logger()
			live, err := ch.open(ctx, logger)
			if err != nil {
				return err
			}
			defer live.Close()
			if into == "" {
				into = live.Database() + "_rebuild"
			}
			if into == live.Database() {
				return fmt.Errorf("--into names the live database %s: rebuild into another and --swap", into)
			}
			// stopped refuses a swap while a projector runs: it writes
			// into the live tables, which the swap drops, and commits
			// offsets past what it wrote.
			stopped := func(when string) error {
				s, err := projector.Status(ctx, projector.StatusConfig{Client: g.kafka.client(logger), Topics: g.kafka.topics(), Group: group})
				if err != nil && !errors.Is(err, projector.ErrNeverCommitted) {
					return err
				}
				if s.Members > 0 {
					return fmt.Errorf("group %s has %d members %s: stop the projector before rebuild --swap", group, s.Members, when)
				}
				return nil
			}
			if swap {
				// Found now, not after an hour of replay.
				if err := stopped("before the replay"); err != nil {
					return err
				}
				// The live tables take the rebuild's, of this build's
				// schema version, only at that version (or never
				// migrated).
				if v, err := live.SchemaVersion(ctx); err != nil {
					return err
				} else if want := chstore.LatestVersion(); v > want {
					return fmt.Errorf("clickhouse database %s is at schema version %d, newer than this build's %d: rebuild --swap with the build that migrated it", live.Database(), v, want)
				} else if v != 0 && v < want {
					return fmt.Errorf("clickhouse database %s is at schema version %d, and the rebuild will be at this build's %d: migrate %s first (`ledger projector migrate`, with the projector stopped), then rebuild --swap", live.Database(), v, want, live.Database())
				}
			}
			fresh, err := chstore.Open(ctx, chstore.Config{DSN: ch.dsn, Database: into, Logger: logger})
			if err != nil {
				return err
			}
			defer fresh.Close()
			if err := fresh.Reset(ctx); err != nil {
				return err
			}
			if err := fresh.Migrate(ctx); err != nil {
				return err
			}
			done, err := projector.Replay(ctx, projector.ReplayConfig{
				Client: g.kafka.client(logger), Topics: g.kafka.topics(), Logger: logger,
				// Records retention deletes while the replay runs stop
				// it, unless the operator accepts losing them.
				SkipDeleted: force,
			}, fresh, projector.NewBar(os.Stderr, "rebuild"))
			if err != nil {
				return err
			}
			// The rebuild holds every record before the replay's
			// ends: a projector going on from them finds so.
			if err := fresh.RecordEnds(ctx, projections.Positions(done.Ends).Ends()); err != nil {
				return err
			}
			sums, err := fresh.Checksums(ctx)
			if err != nil {
				return err
			}
			out := cmd.OutOrStdout()
			fmt.Fprintf(out, "rebuilt %d records into %s in %s\n", done.Done, into, done.Elapsed.Round(time.Millisecond))
			if done.Deleted > 0 {
				fmt.Fprintf(out, "%d offsets were deleted from the log before the replay read them (--force): the rebuild lacks them\n", done.Deleted)
			}
			printChecksums(out, sums)
			replayed := projections.Positions(done.Ends)
			printEnds(out, replayed)
			// Checksums compare only where the projections end alike.
			if pos, err := live.Positions(ctx); err == nil {
				if n := endsDiffer(pos, replayed); n == 0 {
					fmt.Fprintf(out, "the live projection (%s) ends where the rebuild does: its checksums (`ledger projector checksums`, the projector stopped) compare with these\n", live.Database())
				} else {
					fmt.Fprintf(out, "the live projection (%s) ends elsewhere in %d partitions: its checksums differ by the records between (a caught-up projector with nothing new on the log ends where a rebuild does)\n", live.Database(), n)
				}
			}
			if !swap {
				return nil
			}
			// Again: a projector started during the replay (a restart
			// in the hour it can take) has written into the live tables
			// since. Checked first: what it wrote, the rebuild lacks.
			if err := stopped("after the replay (a projector started while it ran); the rebuild is kept in " + into + ", not swapped"); err != nil {
				return err
			}
			// A live database never migrated (a first deployment from a
			// rebuild, a swap that failed half way) has nothing to lose.
			v, err := live.SchemaVersion(ctx)
			if err != nil {
				return err
			}
			if !force && v > 0 {
				if err := rebuildHoldsAll(ctx, live, fresh); err != nil {
					return err
				}
			}
			// The history of control actions the compacted control topic
			// no longer has is kept: nothing else holds it.
			if v > 0 {
				kept, err := fresh.KeepControlHistory(ctx, live)
				if err != nil {
					return fmt.Errorf("%w; not swapped", err)
				}
				if kept > 0 {
					fmt.Fprintf(out, "kept %d control actions of the live tables that the compacted control topic no longer has (a subject's earlier actions)\n", kept)
				}
			}
			// Swap, then move the offsets: offsets moved before a swap
			// that failed would skip records for the live tables; a
			// commit that fails after the swap only has the projector
			// write some records again.
			if err := live.Swap(ctx, fresh); err != nil {
				return err
			}
			if err := projector.CommitOffsets(ctx, g.kafka.client(logger), group, done.Ends); errors.Is(err, projector.ErrGroupActive) {
				// Started in the moment between the check and the swap:
				// its offsets may be past records it wrote into the
				// tables the swap replaced.
				return fmt.Errorf("swapped, but a projector of group %s started during the swap, and may have skipped records: stop it and run rebuild --swap again: %w", group, err)
			} else if err != nil {
				return fmt.Errorf("swapped, but group %s's offsets are not moved to the replay's end (the projector will write again what the rebuild holds, which changes nothing): %w", group, err)
			}
			fmt.Fprintf(out, "swapped: %s now holds the rebuilt tables; group %s goes on from the replay's end\n", live.Database(), group)
			// Emptied by the swap, unless --into held more.
			if dropped, err := fresh.DropIfEmpty(ctx); err != nil {
				fmt.Fprintf(cmd.ErrOrStderr(), "database %s, emptied by the swap, is left: %v\n", into, err)
			} else if dropped {
				fmt.Fprintf(out, "dropped database %s, emptied by the swap\n", into)
			}
			return nil
		},
	}
	rebuild.Flags().StringVar(&into, "into", "", "database to rebuild into (default <database>_rebuild)")
	rebuild.Flags().BoolVar(&swap, "swap", false, "replace the live tables with the rebuilt ones (stop the projector first)")
	rebuild.Flags().BoolVar(&force, "force", false, "replay past records the log deletes while the rebuild runs (else it stops), and with --swap, swap even a rebuild lacking events, or the control actions of subjects, that the live tables hold")
	// A human's decision each time: a LEDGER_FORCE or LEDGER_SWAP left in
	// the environment would take it for them.
	markExplicitOnly(rebuild.Flags(), "swap", "force")

	skipDeleted := &cobra.Command{
		Use:   "skip-deleted",
		Short: "Move a stopped projector's group past records the log deleted before they were projected",
		Long: `skip-deleted is for a projector that stopped because records were deleted from
the log (retention) before it read them: it moves the group's committed offset
of every partition where it lies before the log start to the log start, so that
the projector, started again, goes on from there; and so for every partition
where the group has no committed offset (expired, or deleted) and the log no
longer starts at 0, which the projector refuses to start on over a projection
that holds calls. It also moves where the ClickHouse projection records that
its records end, where that lies before the log start (a database restored
from a backup older than the log's retention), which the projector otherwise
goes back to. The deleted records stay missing from the projection:
answers about the calls they belonged to are incomplete. Stop the projector
first; a group with members is refused.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			ctx := cmd.Context()
			logger := g.logger()
			cc := g.kafka.client(logger)
			s, err := projector.Status(ctx, projector.StatusConfig{Client: cc, Topics: g.kafka.topics(), Group: group})
			if err != nil && !errors.Is(err, projector.ErrNeverCommitted) {
				return err
			}
			if s.Members > 0 {
				return fmt.Errorf("group %s has %d members: stop the projector first: %w", group, s.Members, projector.ErrGroupActive)
			}
			st, err := ch.open(ctx, logger.With("component", "chstore"))
			if err != nil {
				return err
			}
			defer st.Close()
			pos, err := st.Positions(ctx)
			if err != nil {
				return err
			}
			out := cmd.OutOrStdout()
			moves := make(map[string]map[int32]int64)
			var raise []projections.End
			// Said once the offsets are moved.
			var said strings.Builder
			for _, p := range s.Partitions {
				if end, ok := pos.Lookup(p.Topic, p.Partition); ok && end < p.Start {
					raise = append(raise, projections.End{Topic: p.Topic, Partition: p.Partition, Next: p.Start})
					fmt.Fprintf(&said, "%s/%d: the projection's records end at %d, and offsets %d to %d were deleted from the log; it goes on from %d\n",
						p.Topic, p.Partition, end, end, p.Start-1, p.Start)
				}
				if p.Committed >= p.Start || p.Committed < 0 && p.Start == 0 {
					continue
				}
				if moves[p.Topic] == nil {
					moves[p.Topic] = make(map[int32]int64)
				}
				moves[p.Topic][p.Partition] = p.Start
				if p.Committed < 0 {
					fmt.Fprintf(&said, "%s/%d: no committed offset (expired or deleted), and offsets before %d were deleted; the group goes on from %d\n",
						p.Topic, p.Partition, p.Start, p.Start)
					continue
				}
				fmt.Fprintf(&said, "%s/%d: offsets %d to %d were deleted before they were projected; the group goes on from %d\n",
					p.Topic, p.Partition, p.Committed, p.Start-1, p.Start)
			}
			if len(moves) == 0 && len(raise) == 0 {
				fmt.Fprintf(out, "group %s: no committed offset, and no end of the projection's records, lies before the log start; nothing to skip\n", group)
				return nil
			}
			// The projection's ends first: moved alone, the group's
			// offsets would still have the projector go back before
			// the log start.
			if err := st.RecordEnds(ctx, raise); err != nil {
				return err
			}
			if len(moves) > 0 {
				if err := projector.CommitOffsets(ctx, cc, group, moves); err != nil {
					return err
				}
			}
			fmt.Fprint(out, said.String())
			return nil
		},
	}

	recordEnds := &cobra.Command{
		Use:   "record-ends",
		Short: "Record that the projection's records end where the group is, in each partition it has no end of (a database restored from a backup without ends)",
		Long: `record-ends is for a ClickHouse database restored from a backup taken before the
projection recorded where its records end (schema version 8), or a new
database, behind a group that projected into the one it replaces: a projector
holds the partitions the group committed with an end while the database has
none (` + "`ledger projector status --clickhouse-dsn`" + ` counts them), since it cannot
tell what the database lacks. record-ends records, for each partition of the
events and control topics the projection has no end of, that its records end
at the group's committed offset (at the log start where the group has none),
and the projector goes on from there. What the database lacks before those
offsets stays missing from it: answers about those calls are incomplete. To
have everything the log still holds instead, run ` + "`ledger projector rebuild --swap`" + `.
Run it once the restore is done; a running projector goes on at its next lag
refresh.`,
		Args: cobra.NoArgs,
		RunE: ch.with(g, func(cmd *cobra.Command, st *chstore.Store) error {
			ctx := cmd.Context()
			// A backup of an older schema version has no table of
			// ends to record them in.
			if err := checkSchema(ctx, st); err != nil {
				return err
			}
			s, err := projector.Status(ctx, projector.StatusConfig{Client: g.kafka.client(g.logger()), Topics: g.kafka.topics(), Group: group})
			if errors.Is(err, projector.ErrNeverCommitted) {
				// Every end would be the log start: most likely the
				// wrong group (dev's is another).
				return fmt.Errorf("group %s has committed no offset: is it the projector's group? (`ledger dev`'s is %s): %w", group, devProjectorGroup, err)
			}
			if err != nil {
				return err
			}
			pos, err := st.Positions(ctx)
			if err != nil {
				return err
			}
			var ends []projections.End
			var said strings.Builder
			for _, p := range s.Partitions {
				if _, ok := pos.Lookup(p.Topic, p.Partition); ok {
					continue
				}
				at, where := p.Committed, "the group's offset"
				if at < 0 {
					at, where = p.Start, "the log start: the group has no offset there"
				}
				ends = append(ends, projections.End{Topic: p.Topic, Partition: p.Partition, Next: at})
				fmt.Fprintf(&said, "%s/%d: the projection's records end at %d (%s)\n", p.Topic, p.Partition, at, where)
			}
			out := cmd.OutOrStdout()
			if len(ends) == 0 {
				fmt.Fprintf(out, "clickhouse database %s has an end of every partition; nothing to record\n", st.Database())
				return nil
			}
			if err := st.RecordEnds(ctx, ends); err != nil {
				return err
			}
			fmt.Fprint(out, said.String())
			return nil
		}),
	}

	var sumsJSON bool
	checksums := &cobra.Command{
		Use:   "checksums",
		Short: "Print a checksum of every projection table (rows and a hash over them, as merged), and where the projection's records end, to compare two projections",
		Args:  cobra.NoArgs,
		RunE: ch.with(g, func(cmd *cobra.Command, st *chstore.Store) error {
			// Where the projection ends, before and after the sums:
			// a projector writing meanwhile moves it.
			before, beforeErr := st.Positions(cmd.Context())
			sums, err := st.Checksums(cmd.Context())
			if err != nil {
				return err
			}
			if sumsJSON {
				return printJSONTo(cmd.OutOrStdout(), sums)
			}
			printChecksums(cmd.OutOrStdout(), sums)
			// A database of an older schema version has no ends to
			// say.
			after, err := st.Positions(cmd.Context())
			switch {
			case err != nil || beforeErr != nil:
			case endsDiffer(before, after) > 0:
				fmt.Fprintln(cmd.OutOrStdout(), "the projection moved while its checksums were taken (a projector writing): they compare with no other; stop the projector and run this again")
			default:
				printEnds(cmd.OutOrStdout(), after)
			}
			return nil
		}),
	}
	checksums.Flags().BoolVar(&sumsJSON, "json", false, "print JSON")
	cmd.AddCommand(migrate, status, rebuild, skipDeleted, recordEnds, checksums)
	return cmd
}

// checkSchema refuses to project into tables of another schema version.
func checkSchema(ctx context.Context, st *chstore.Store) error {
	v, err := st.SchemaVersion(ctx)
	if err != nil {
		return err
	}
	if want := chstore.LatestVersion(); v != want {
		return fmt.Errorf("clickhouse database %s is at schema version %d, this build writes %d: run `ledger projector migrate`", st.Database(), v, want)
	}
	return nil
}

// with runs fn on the store the flags name, closing it after.
func (c *clickhouseFlags) with(g *globals, fn func(cmd *cobra.Command, st *chstore.Store) error) func(*cobra.Command, []string) error {
	return func(cmd *cobra.Command, _ []string) error {
		st, err := c.open(cmd.Context(), g.logger())
		if err != nil {
			return err
		}
		defer st.Close()
		return fn(cmd, st)
	}
}

// rebuildHoldsAll refuses a swap of live's tables for fresh's (a rebuild
// from the log) that would lose what the log no longer has: an event the
// live tables hold and the rebuild lacks (past the events topic's
// retention), or a control subject (deleted by a tombstone). Compared by
// id, not counted: the rebuild also holds what the live projection had
// not written yet, which would hide as many it lost. Not control
// actions: the control topic is compacted, each subject keeping its
// latest action, so a rebuild lacks some after any freeze and unfreeze of
// one tool, and a refusal then made --force (which lets everything
// through) routine.
func rebuildHoldsAll(ctx context.Context, live, fresh *chstore.Store) error {
	events, subjects, err := live.Lacking(ctx, fresh)
	if err != nil {
		return err
	}
	if events > 0 {
		return fmt.Errorf("the rebuild in %s lacks %d of the events the live tables hold: the log no longer has them all (retention); not swapped (--force to swap anyway)", fresh.Database(), events)
	}
	if subjects > 0 {
		return fmt.Errorf("the rebuild in %s lacks the control actions of %d subjects the live tables hold: the control topic no longer has them all (a subject deleted by a tombstone); not swapped (--force to swap anyway)", fresh.Database(), subjects)
	}
	return nil
}

// projectionGap reports whether st holds nothing of a topic (no events,
// or no control actions) while group has committed offsets on it past
// committed records of the log (aborted writes are none): a projector in
// the group would resume there and leave the projection without
// everything before. It returns the log's start
// offsets, to reset the group to.
func projectionGap(ctx context.Context, st *chstore.Store, cc ledger.ClientConfig, topics ledger.Topics, group string) (map[string]map[int32]int64, bool, error) {
	topics = topics.WithDefaults()
	held, err := projectionHolds(ctx, st, topics)
	if err != nil || held[topics.Events] && held[topics.Control] {
		return nil, false, err
	}
	s, err := projector.Status(ctx, projector.StatusConfig{Client: cc, Topics: topics, Group: group})
	if errors.Is(err, projector.ErrNeverCommitted) {
		return nil, false, nil
	}
	if err != nil {
		return nil, false, err
	}
	gap := false
	for _, p := range s.Partitions {
		if held[p.Topic] || p.Committed <= p.Start {
			continue
		}
		// Offsets of aborted writes alone are none: a projector commits
		// past them, writing nothing, and rebuilding would find nothing
		// either.
		data, err := projector.HoldsRecords(ctx, cc, p.Topic, p.Partition, p.Start, p.Committed)
		if err != nil {
			return nil, false, err
		}
		gap = gap || data
	}
	return logStarts(s.Partitions), gap, nil
}

// projectionHolds says which of topics (WithDefaults) st holds something
// of: their committed offsets are the projection's own (a control record
// projected before the first event is no gap in the events). A
// projection holding events holds the control topic too, whatever its
// rows: the projector commits past control records it writes nothing for
// (tombstones, records it cannot read), and compaction keeps the log's
// start where it was.
func projectionHolds(ctx context.Context, st *chstore.Store, topics ledger.Topics) (map[string]bool, error) {
	events, err := st.EventRows(ctx)
	if err != nil {
		return nil, err
	}
	controls, err := st.ControlRows(ctx)
	if err != nil {
		return nil, err
	}
	return map[string]bool{topics.Events: events > 0, topics.Control: controls > 0 || events > 0}, nil
}

// startOffsets checks, before a projector starts, the partitions where
// group has no committed offset, and commits one where none is lost.
//
// The projector commits a partition only once it has read records of it,
// so a partition can lack an offset for a harmless reason (nothing to read
// yet, or a first catch-up stopped early): startOffsets commits the log's
// start there, where kgo would begin anyway, so that from this build on
// every partition has an offset from the projector's first start. An
// offset missing afterwards, on a topic the projection holds, where the
// log no longer starts at 0, means the group's offsets expired (Kafka
// drops an empty group's after offsets.retention.minutes, 7 days by
// default) or were deleted, and the records retention removed meanwhile
// may never have been projected: those partitions are returned as lost,
// and nothing is committed. A projector would go on from the log's start
// without a word, where one whose offsets lie before the start stops
// (ErrRecordsDeleted). A group with members is left alone: Kafka keeps a
// live group's offsets, and its members may be catching up.
func startOffsets(ctx context.Context, st *chstore.Store, cc ledger.ClientConfig, topics ledger.Topics, group string) (lost []string, _ error) {
	topics = topics.WithDefaults()
	held, err := projectionHolds(ctx, st, topics)
	if err != nil {
		return nil, err
	}
	s, err := projector.Status(ctx, projector.StatusConfig{Client: cc, Topics: topics, Group: group})
	if err != nil && !errors.Is(err, projector.ErrNeverCommitted) {
		return nil, err
	}
	if s.Members > 0 {
		return nil, nil
	}
	unstarted := make(map[string]map[int32]int64)
	for _, p := range s.Partitions {
		switch {
		case p.Committed >= 0:
		case held[p.Topic] && p.Start > 0:
			lost = append(lost, fmt.Sprintf("%s/%d (the log starts at %d)", p.Topic, p.Partition, p.Start))
		default:
			if unstarted[p.Topic] == nil {
				unstarted[p.Topic] = make(map[int32]int64)
			}
			unstarted[p.Topic][p.Partition] = p.Start
		}
	}
	if len(lost) > 0 || len(unstarted) == 0 {
		return lost, nil
	}
	if err := projector.CommitOffsets(ctx, cc, group, unstarted); err != nil && !errors.Is(err, projector.ErrGroupActive) {
		// The broker refuses an outside commit to a group a member
		// joined after the check (another replica starting): that
		// member's projector commits as it reads.
		if s, serr := projector.Status(ctx, projector.StatusConfig{Client: cc, Topics: topics, Group: group}); (serr == nil || errors.Is(serr, projector.ErrNeverCommitted)) && s.Members > 0 {
			return nil, nil
		}
		return nil, err
	}
	return nil, nil
}

// logStarts is where each partition's log starts, by topic.
func logStarts(parts []projector.PartitionStatus) map[string]map[int32]int64 {
	starts := make(map[string]map[int32]int64)
	for _, p := range parts {
		if starts[p.Topic] == nil {
			starts[p.Topic] = make(map[int32]int64)
		}
		starts[p.Topic][p.Partition] = p.Start
	}
	return starts
}
