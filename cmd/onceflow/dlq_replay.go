package main

import (
	"errors"
	"fmt"
	"io"
	"sort"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/spf13/cobra"

	"github.com/onceflow/onceflow/broker"
	"github.com/onceflow/onceflow/messagedata"
)

// replayed and kept are the entries of a replay report.
type replayed struct {
	ID      string `json:"id"`
	To      string `json:"to"`
	Handler string `json:"handler"`
	Attempt int    `json:"attempt"`
	Reason  string `json:"reason"`
	Replays int    `json:"replays"`
}

type kept struct {
	ID      string `json:"id"`
	Topic   string `json:"topic"`
	Handler string `json:"handler"`
	Reason  string `json:"reason"`
}

// replayReport is the JSON document of dlq replay.
type replayReport struct {
	Broker   string     `json:"broker"`
	Topic    string     `json:"topic"`
	Group    string     `json:"group"`
	Replayed []replayed `json:"replayed"`
	Kept     []kept     `json:"kept"`
	// NotFound lists the --id values that matched no dead letter.
	NotFound []string `json:"not_found"`
	// NoTopic lists the selected dead letters left in place because they name no original
	// topic and --to was not given.
	NoTopic []string `json:"no_topic"`
	// Limited is true when the replay looked at --limit dead letters: more may be waiting.
	Limited bool `json:"limited"`
}

func newDLQReplayCommand() *cobra.Command {
	var f dlqFlags
	var ids []string
	var all bool
	var to string
	cmd := &cobra.Command{
		Use:   "replay",
		Short: "Put dead letters back on the topic they came from",
		Long: `Publishes the chosen dead letters (--id, repeatable, or --all) to the topic they were consumed
from (their onceflow_dlq_topic header, or --to), and only once the broker has stored that
publish removes them from the dead-letter topic. The others stay where they are, in their order.

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

The exit status is 1 when an --id matched no dead letter or a chosen dead letter names no topic.`,
		Example: `  onceflow dlq replay --broker sqlite://var/queue.db --id order-17 --id order-18
  onceflow dlq replay --broker 'nats://127.0.0.1:4222?group=billing' --all
  onceflow dlq replay --broker "$ONCEFLOW_BROKER" --all --to orders.retry --json`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if all == (len(ids) > 0) {
				return errors.New("choose the dead letters to replay: --id ID (repeatable) or --all")
			}
			wanted := map[string]bool{}
			for _, id := range ids {
				wanted[id] = true
			}
			b, err := f.open(cmd.Context())
			if err != nil {
				return err
			}
			defer b.Close()

			now := time.Now().UTC().Format(time.RFC3339Nano)
			rep := replayReport{Broker: b.String(), Topic: f.topic, Group: b.ConsumerGroup(),
				Replayed: []replayed{}, Kept: []kept{}, NotFound: []string{}, NoTopic: []string{}}
			found := map[string]bool{}
			res, moveErr := b.Move(cmd.Context(), f.topic, f.limit, func(m *message.Message) (string, *message.Message) {
				if !all && !wanted[m.UUID] {
					return "", nil
				}
				found[m.UUID] = true
				dest := to
				if dest == "" {
					dest = m.Metadata.Get(messagedata.HeaderDeadLetterTopic)
				}
				if dest == "" {
					rep.NoTopic = append(rep.NoTopic, m.UUID)
					return "", nil
				}
				return dest, replayMessage(m, now)
			})
			for _, mv := range res.Moved {
				d := describe(mv.Message, false)
				rep.Replayed = append(rep.Replayed, replayed{ID: d.ID, To: mv.To, Handler: d.Handler, Attempt: d.Attempt,
					Reason: d.Reason, Replays: d.Replays + 1})
			}
			for _, m := range res.Kept {
				d := describe(m, false)
				rep.Kept = append(rep.Kept, kept{ID: d.ID, Topic: d.Topic, Handler: d.Handler, Reason: d.Reason})
			}
			for id := range wanted {
				if !found[id] {
					rep.NotFound = append(rep.NotFound, id)
				}
			}
			sort.Strings(rep.NotFound)
			rep.Limited = len(res.Moved)+len(res.Kept) >= f.limit

			if f.asJSON {
				if err := writeJSON(cmd.OutOrStdout(), rep); err != nil {
					return errors.Join(moveErr, err)
				}
			} else {
				printReplay(cmd.OutOrStdout(), rep)
			}
			var errs []error
			if moveErr != nil {
				errs = append(errs, moveErr)
			}
			if len(rep.NotFound) > 0 {
				errs = append(errs, fmt.Errorf("no dead letter with id %s in %s for consumer group %s", strings.Join(quoteAll(rep.NotFound), ", "), f.topic, b.ConsumerGroup()))
			}
			if len(rep.NoTopic) > 0 {
				errs = append(errs, fmt.Errorf("dead letters %s name no original topic (header %s): pass --to", strings.Join(quoteAll(rep.NoTopic), ", "), messagedata.HeaderDeadLetterTopic))
			}
			return errors.Join(errs...)
		},
	}
	f.register(cmd, defaultReplayLimit, "look at most at this many dead letters, oldest first")
	fl := cmd.Flags()
	fl.StringArrayVar(&ids, "id", nil, "id of a dead letter to replay (repeatable)")
	fl.BoolVar(&all, "all", false, "replay every dead letter waiting (up to --limit)")
	fl.StringVar(&to, "to", "", "publish to this topic instead of the one each dead letter came from")
	return cmd
}

// replayMessage returns the message that replays dead letter m: its id (the original one, when
// the dead-letter broker could not carry it and the dead letter kept it in a header), payload
// and headers, without the dead-letter headers, with the replay count and time.
func replayMessage(m *message.Message, now string) *message.Message {
	id := m.UUID
	if orig := m.Metadata.Get(messagedata.HeaderDeadLetterOriginalID); orig != "" {
		id = orig
	}
	out := message.NewMessage(id, m.Payload)
	for k, v := range m.Metadata {
		out.Metadata[k] = v
	}
	for _, h := range deadLetterHeaders {
		delete(out.Metadata, h)
	}
	// Properties of the delivery the dead letter was read from, not of the message.
	delete(out.Metadata, broker.HeaderAMQPRedelivered)
	n, _ := strconv.Atoi(m.Metadata.Get(messagedata.HeaderReplayCount))
	out.Metadata[messagedata.HeaderReplayCount] = strconv.Itoa(n + 1)
	out.Metadata[messagedata.HeaderReplayTime] = now
	return out
}

// printReplay writes the readable form of a replay report.
func printReplay(w io.Writer, rep replayReport) {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	for _, r := range rep.Replayed {
		fmt.Fprintf(tw, "replayed\t%s\t-> %s\thandler %s, attempt %d: %s\n", cell(r.ID, 0), cell(r.To, 0), cell(r.Handler, 0), r.Attempt, cell(r.Reason, tableReasonWidth))
	}
	for _, k := range rep.Kept {
		fmt.Fprintf(tw, "kept\t%s\t   %s\thandler %s: %s\n", cell(k.ID, 0), cell(k.Topic, 0), cell(k.Handler, 0), cell(k.Reason, tableReasonWidth))
	}
	tw.Flush()
	more := ""
	if rep.Limited {
		more = " (the first --limit; more may be waiting)"
	}
	fmt.Fprintf(w, "replayed %s, kept %d %s%s\n",
		plural(len(rep.Replayed), "dead letter"), len(rep.Kept), where(rep.Topic, rep.Group, rep.Broker), more)
	for _, id := range rep.NotFound {
		fmt.Fprintf(w, "not found: %s\n", printable(id))
	}
	for _, id := range rep.NoTopic {
		fmt.Fprintf(w, "no original topic: %s (pass --to)\n", printable(id))
	}
}
