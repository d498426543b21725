package onceflowtest

import (
	"math/rand/v2"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/onceflow/onceflow/ordering"
)

// This file publishes a run's messages: out of order, some twice, with the poison messages
// among them.

// publishers is how many goroutines publish at once: a broker that confirms each message
// (RabbitMQ with publisher confirms) needs several in flight to reach its own rate, and batches
// that race each other reach the broker out of order.
const publishers = 8

// reorderWindow is the span within which the publish order is shuffled.
const reorderWindow = 16

// toWatermill returns m as a message to publish.
func (m Message) toWatermill() *message.Message {
	out := message.NewMessage(m.ID, m.Payload)
	for k, v := range m.Metadata {
		out.Metadata.Set(k, v)
	}
	if m.Key != "" {
		ordering.SetSequence(out, m.Key, m.Sequence)
	}
	return out
}

// publishOrder returns the order in which to publish n messages and the second copies of the
// messages dups: each message's place shuffled within a window of reorderWindow, and each
// second copy at a random place after its first. An entry is a message's number.
func publishOrder(n int, dups []int, rng *rand.Rand) []int {
	order := make([]int, n)
	for i := range order {
		order[i] = i
	}
	for start := 0; start < n; start += reorderWindow {
		w := order[start:min(start+reorderWindow, n)]
		rng.Shuffle(len(w), func(i, j int) { w[i], w[j] = w[j], w[i] })
	}
	place := make([]int, n)
	for pos, i := range order {
		place[i] = pos
	}
	after := make([][]int, n) // the second copies that go after each position
	for _, i := range dups {
		pos := place[i] + rng.IntN(n-place[i])
		after[pos] = append(after[pos], i)
	}
	out := make([]int, 0, n+len(dups))
	for pos, i := range order {
		out = append(out, i)
		out = append(out, after[pos]...)
	}
	return out
}

// publish sends msgs to topic in order (a number of msgs each), with poison[p] placed before
// the good message at p*len(order)/len(poison), in batches spread over several goroutines and
// over about the duration over.
func publish(pub message.Publisher, topic string, msgs []Message, order []int, poison []*message.Message, over time.Duration) error {
	// An entry below 0 stands for poison[-1-entry].
	entries := make([]int, 0, len(order)+len(poison))
	for pos, i := range order {
		for p := range poison {
			if pos == p*len(order)/len(poison) {
				entries = append(entries, -1-p)
			}
		}
		entries = append(entries, i)
	}

	// At least 20 batches, so that the publishing is spread; at most 100 messages in one.
	batch := max(1, min(100, len(entries)/20))
	batches := (len(entries) + batch - 1) / batch
	started := time.Now()
	work := make(chan []int)
	errs := make(chan error, publishers)
	var wg sync.WaitGroup
	for range publishers {
		wg.Go(func() {
			for chunk := range work {
				out := make([]*message.Message, len(chunk))
				for j, i := range chunk {
					if i < 0 {
						out[j] = poison[-1-i]
					} else {
						out[j] = msgs[i].toWatermill()
					}
				}
				if err := pub.Publish(topic, out...); err != nil {
					errs <- err
					return
				}
			}
		})
	}
	var err error
loop:
	for k, start := 0, 0; start < len(entries); k, start = k+1, start+batch {
		if wait := time.Until(started.Add(over * time.Duration(k) / time.Duration(batches))); wait > 0 {
			time.Sleep(wait)
		}
		select {
		case work <- entries[start:min(start+batch, len(entries))]:
		case err = <-errs:
			break loop
		}
	}
	close(work)
	wg.Wait()
	if err == nil {
		select {
		case err = <-errs:
		default:
		}
	}
	return err
}
