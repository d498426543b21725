package main

import (
	"errors"
	"fmt"
	"io"
	"text/tabwriter"

	"github.com/spf13/cobra"

	"github.com/onceflow/onceflow/deadletter"
)

// replayed is an entry of a replay report.
type replayed struct {
	ID         string `json:"id"`
	To         string `json:"to"`
	Handler    string `json:"handler"`
	Deliveries int    `json:"deliveries"`
	Attempt    int    `json:"attempt"`
	Reason     string `json:"reason"`
	Replays    int    `json:"replays"`
}

// replayReport is the JSON document of dlq replay.
type replayReport struct {
	Broker   string     `json:"broker"`
	Topic    string     `json:"topic"`
	Group    string     `json:"group"`
	Replayed []replayed `json:"replayed"`
	// Failed lists the chosen dead letters that were not replayed, each with why: they wait in
	// their place.
	Failed []failed `json:"failed"`
	// Kept lists the dead letters not chosen.
	Kept []kept `json:"kept"`
	// NotFound lists the --id values that matched no dead letter.
	NotFound []string `json:"not_found"`
	// Limited is true when the replay looked at --limit dead letters: more may be waiting.
	Limited bool `json:"limited"`
}

func newDLQReplayCommand() *cobra.Command {
	var f dlqFlags
	var sel selection
	var to string
	cmd := &cobra.Command{
		Use:   "replay",
		Short: "Put dead letters back on the topic they came from",
		Long: `Publishes the chosen dead letters to the topic they were consumed from (their
onceflow_dlq_topic header, or --to), and only once the broker has stored that publish removes
them from the dead-letter topic. The others stay where they are, in their order. Choose them
with exactly one of --id (repeatable; the id dlq list shows, or the original id of a dead
letter that could not carry it), a filter (--reason: every dead letter whose reason contains
the text, case-sensitive, so that a whole reason copied from dlq list is an exact match;
--handler, --from-topic, --since, --until; given together, a dead letter must match them all)
or --all.

A chosen dead letter that cannot be replayed stays where it is, and replay goes on with the
next one: one whose payload the dead-letter broker refused (header
onceflow_dlq_payload_dropped), which would reach the handler empty; one that names no topic
when --to is not given; one the broker refuses to take back (an id or a header it cannot
carry, such as a 256-byte id on RabbitMQ). The report names each, with why.

A replayed message keeps its original id, payload and headers, so it goes through the handler's
duplicate detection again: a message that was in fact applied is acknowledged without being
applied again, and replaying the same message twice applies it at most once. The dead-letter
headers (onceflow_dlq_*) are removed; onceflow_replay_count counts the replays and
onceflow_replay_time says when the last one was. A crash between the publish and the removal
leaves the dead letter in place as well: it is replayed again next time, and deduplication
absorbs the duplicate. Nothing is lost.

What removal means: RabbitMQ acknowledges the message on the group's queue (other groups'
queues keep their copies); the SQL and SQLite queues delete its row, NATS deletes it from the
stream, Redis acknowledges it for the group and deletes the entry: other consumer groups of the
dead-letter topic no longer see it either. On NATS the replay is published with a Nats-Msg-Id of
its own, so that JetStream does not drop it as a duplicate of the original publish.

The exit status is 1 when a chosen dead letter was not replayed, or an --id or the filter
matched no dead letter.`,
		Example: `  onceflow dlq replay --broker sqlite://var/queue.db --id order-17 --id order-18
  onceflow dlq replay --broker "$ONCEFLOW_BROKER" --reason 'account 7 is closed'
  onceflow dlq replay --broker "$ONCEFLOW_BROKER" --handler ledger --since 1h
  onceflow dlq replay --broker 'nats://127.0.0.1:4222?group=billing' --all
  onceflow dlq replay --broker "$ONCEFLOW_BROKER" --all --to orders.retry --json`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			s, err := sel.resolve(cmd, "replay")
			if err != nil {
				return err
			}
			q, closeBroker, err := f.open(cmd.Context(), f.limit)
			if err != nil {
				return err
			}
			defer closeBroker()

			res, replayErr := q.Replay(cmd.Context(), s, deadletter.ReplayOptions{To: to})
			rep := replayReport{Broker: q.Broker(), Topic: q.Topic(), Group: q.Group(), Replayed: []replayed{},
				Failed: failures(res.Failed), Kept: keptOf(res.Kept), NotFound: res.NotFound, Limited: res.Truncated}
			for _, r := range res.Done {
				l := r.Letter
				rep.Replayed = append(rep.Replayed, replayed{ID: l.ID, To: r.To, Handler: l.Handler, Deliveries: l.Deliveries, Attempt: l.Attempt, Reason: l.Reason, Replays: l.Replays + 1})
			}
			if f.asJSON {
				if err := writeJSON(cmd.OutOrStdout(), rep); err != nil {
					return errors.Join(replayErr, err)
				}
			} else {
				printReplay(cmd.OutOrStdout(), rep)
			}
			return errors.Join(notFound(replayErr, q), missed(s, res, q))
		},
	}
	f.register(cmd, defaultReplayLimit, "look at most at this many dead letters, oldest first")
	sel.register(cmd, "replay")
	cmd.Flags().StringVar(&to, "to", "", "publish to this topic instead of the one each dead letter came from")
	return cmd
}

// printReplay writes the readable form of a replay report.
func printReplay(w io.Writer, rep replayReport) {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	for _, r := range rep.Replayed {
		fmt.Fprintf(tw, "replayed\t%s\t-> %s\thandler %s, delivery %s, attempt %d: %s\n", cell(r.ID, 0), cell(r.To, 0), cell(r.Handler, 0), count(r.Deliveries), r.Attempt, cell(r.Reason, tableReasonWidth))
	}
	for _, k := range rep.Kept {
		fmt.Fprintf(tw, "kept\t%s\t   %s\thandler %s: %s\n", cell(k.ID, 0), cell(k.Topic, 0), cell(k.Handler, 0), cell(k.Reason, tableReasonWidth))
	}
	tw.Flush()
	more := ""
	if rep.Limited {
		more = " (the first --limit; more may be waiting)"
	}
	fmt.Fprintf(w, "replayed %s, %skept %d %s%s\n",
		plural(len(rep.Replayed), "dead letter"), failedCount(len(rep.Failed)), len(rep.Kept), where(rep.Topic, rep.Group, rep.Broker), more)
	for _, f := range rep.Failed {
		fmt.Fprintf(w, "not replayed: %s: %s\n", printable(f.ID), printable(f.Error))
	}
	for _, id := range rep.NotFound {
		fmt.Fprintf(w, "not found: %s\n", printable(id))
	}
}
