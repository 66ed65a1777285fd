import java.nio.charset.StandardCharsets;
import java.util.ArrayList;
import java.util.List;
import java.util.UUID;
import java.util.concurrent.CompletionException;
import java.util.concurrent.ExecutionException;
import java.util.concurrent.TimeUnit;
import org.apache.pulsar.client.api.AuthenticationFactory;
import org.apache.pulsar.client.api.ClientBuilder;
import org.apache.pulsar.client.api.Consumer;
import org.apache.pulsar.client.api.Message;
import org.apache.pulsar.client.api.Producer;
import org.apache.pulsar.client.api.PulsarClient;
import org.apache.pulsar.client.api.Schema;
import org.apache.pulsar.client.api.SubscriptionInitialPosition;
import org.apache.pulsar.client.api.transaction.Transaction;
import org.apache.pulsar.client.api.transaction.TxnID;
import org.apache.pulsar.client.impl.PulsarClientImpl;
import org.apache.pulsar.client.impl.transaction.TransactionCoordinatorClientImpl;

/**
 * Drives Pulsar transactions with Pulsar's own Java client, one step per process, so a test can
 * kill the process that opened a transaction and end it from another one by its TxnID.
 *
 * <pre>
 * open SERVICE_URL TIMEOUT_MS TOPIC N [TOPIC N ...]   prints "TXN most least", then waits to be killed
 * end SERVICE_URL MOST LEAST commit|abort [MOST LEAST commit|abort ...]
 *                                                     prints "END most least action OK" or
 *                                                     "END most least action ERR class | message | cause class | cause message"
 * send SERVICE_URL TOPIC N                            produces N messages outside any transaction
 * read SERVICE_URL IDLE_MS TOPIC [TOPIC ...]          prints "READ topic count values" (committed data only)
 * </pre>
 * Env PULSAR_AUTH_TOKEN, when set, authenticates with that JWT.
 */
public final class TxnProbe {
    private TxnProbe() {}

    public static void main(String[] args) throws Exception {
        String command = args[0];
        String url = args[1];
        int code = 0;
        try {
            switch (command) {
                case "open" -> open(url, Long.parseLong(args[2]), args);
                case "end" -> end(url, args);
                case "read" -> read(url, Long.parseLong(args[2]), args);
                case "send" -> send(url, args[2], Integer.parseInt(args[3]));
                default -> throw new IllegalArgumentException("unknown command " + command);
            }
        } catch (Throwable e) {
            System.out.println("FAIL " + describe(e));
            code = 2;
        }
        System.out.flush();
        // The client's netty threads are not daemons: leave without waiting for them.
        Runtime.getRuntime().halt(code);
    }

    private static PulsarClient client(String url) throws Exception {
        ClientBuilder builder = PulsarClient.builder().serviceUrl(url).enableTransaction(true)
                .operationTimeout(20, TimeUnit.SECONDS);
        String token = System.getenv("PULSAR_AUTH_TOKEN");
        if (token != null && !token.isEmpty()) {
            builder.authentication(AuthenticationFactory.token(token));
        }
        return builder.build();
    }

    private static void open(String url, long timeoutMs, String[] args) throws Exception {
        PulsarClient client = client(url);
        Transaction txn = client.newTransaction()
                .withTransactionTimeout(timeoutMs, TimeUnit.MILLISECONDS).build().get();
        TxnID id = txn.getTxnID();
        for (int i = 3; i + 1 < args.length; i += 2) {
            String topic = args[i];
            int n = Integer.parseInt(args[i + 1]);
            Producer<byte[]> producer = client.newProducer().topic(topic)
                    .sendTimeout(0, TimeUnit.SECONDS).enableBatching(false).create();
            for (int k = 0; k < n; k++) {
                producer.newMessage(txn).value(("m" + k).getBytes(StandardCharsets.UTF_8)).send();
            }
        }
        System.out.println("TXN " + id.getMostSigBits() + " " + id.getLeastSigBits());
        System.out.flush();
        Thread.sleep(Long.MAX_VALUE);
    }

    private static void send(String url, String topic, int n) throws Exception {
        PulsarClient client = client(url);
        Producer<byte[]> producer = client.newProducer().topic(topic).enableBatching(false).create();
        for (int k = 0; k < n; k++) {
            producer.send(("plain" + k).getBytes(StandardCharsets.UTF_8));
        }
        System.out.println("SENT " + topic + " " + n);
    }

    private static void end(String url, String[] args) throws Exception {
        PulsarClient client = client(url);
        TransactionCoordinatorClientImpl tc = ((PulsarClientImpl) client).getTcClient();
        for (int i = 2; i + 2 < args.length; i += 3) {
            TxnID id = new TxnID(Long.parseLong(args[i]), Long.parseLong(args[i + 1]));
            String action = args[i + 2];
            String head = "END " + args[i] + " " + args[i + 1] + " " + action + " ";
            try {
                if (action.equals("commit")) {
                    tc.commit(id);
                } else {
                    tc.abort(id);
                }
                System.out.println(head + "OK");
            } catch (Exception e) {
                System.out.println(head + "ERR " + describe(e));
            }
            System.out.flush();
        }
    }

    private static String describe(Throwable e) {
        Throwable t = e;
        while ((t instanceof CompletionException || t instanceof ExecutionException) && t.getCause() != null) {
            t = t.getCause();
        }
        Throwable cause = t.getCause();
        String c = cause == null ? "-" : cause.getClass().getName() + " | " + oneLine(cause.getMessage());
        return t.getClass().getName() + " | " + oneLine(t.getMessage()) + " | " + c;
    }

    private static String oneLine(String s) {
        return s == null ? "" : s.replace('\n', ' ');
    }

    private static void read(String url, long idleMs, String[] args) throws Exception {
        PulsarClient client = client(url);
        for (int i = 3; i < args.length; i++) {
            String topic = args[i];
            Consumer<byte[]> consumer = client.newConsumer(Schema.BYTES).topic(topic)
                    .subscriptionName("probe-" + UUID.randomUUID())
                    .subscriptionInitialPosition(SubscriptionInitialPosition.Earliest).subscribe();
            int count = 0;
            List<String> values = new ArrayList<>();
            while (true) {
                Message<byte[]> m = consumer.receive((int) idleMs, TimeUnit.MILLISECONDS);
                if (m == null) {
                    break;
                }
                count++;
                values.add(new String(m.getValue(), StandardCharsets.UTF_8));
                consumer.acknowledge(m);
            }
            System.out.println("READ " + topic + " " + count + " " + String.join(",", values));
            System.out.flush();
        }
    }
}
